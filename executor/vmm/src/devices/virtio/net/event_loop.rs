//! The device thread: waits on the tap and the queue notification eventfds (epoll), moves
//! frames both ways, and resends interrupts the guest never saw.

use std::sync::{Arc, Mutex};

use vmm_sys_util::epoll::{Epoll, EpollEvent};

use super::device::{DeviceState, TOKEN_KICK, TOKEN_QUEUE_BASE, TOKEN_TAP};
use crate::devices::virtio::{queue_events, LostIrqs};

pub(super) fn run(state: Arc<Mutex<DeviceState>>, epoll: Arc<Epoll>) {
    let mut events = vec![EpollEvent::default(); 8];
    let mut lost = LostIrqs::default();
    loop {
        let Some(n) = queue_events::wait(&epoll, &mut events, lost.watching(), "net") else {
            return;
        };
        let mut g = state.lock().unwrap();
        if g.stopped {
            return;
        }
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_TAP => g.tap_readable(),
                TOKEN_KICK => g.kicked(),
                t if t >= TOKEN_QUEUE_BASE => {
                    let q = (t - TOKEN_QUEUE_BASE) as usize;
                    // Already consumed (a pause drained it): nothing new to look at.
                    if g.queue_events.take(q) {
                        g.on_queue_notify(q);
                    }
                }
                _ => {}
            }
        }
        g.flush_irq();
        if let Some(resent) = lost.check(g.irq.as_ref(), g.paused) {
            if resent.is_power_of_two() {
                tracing::warn!(
                    resent,
                    "net: interrupt not acknowledged for {:?}; sent it again",
                    LostIrqs::RESEND_AFTER
                );
            }
        }
    }
}
