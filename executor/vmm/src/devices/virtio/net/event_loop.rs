//! The device's event loop: waits on the tap and the queue notification eventfds (epoll),
//! moves frames both ways, and resends interrupts the guest never saw. Run on a thread of the
//! device's own ([`Pump::run`]) or turned by the VM's owner ([`DeviceLoop`]).

use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vmm_sys_util::epoll::{Epoll, EpollEvent};

use super::device::{DeviceState, TOKEN_KICK, TOKEN_QUEUE_BASE, TOKEN_TAP};
use crate::devices::virtio::{queue_events, DeviceLoop, LostIrqs};

pub(super) struct Pump {
    state: Arc<Mutex<DeviceState>>,
    epoll: Arc<Epoll>,
    events: Vec<EpollEvent>,
    lost: LostIrqs,
}

impl Pump {
    pub(super) fn new(state: Arc<Mutex<DeviceState>>, epoll: Arc<Epoll>) -> Pump {
        Pump {
            state,
            epoll,
            events: vec![EpollEvent::default(); 8],
            lost: LostIrqs::default(),
        }
    }

    /// The device's own thread.
    pub(super) fn run(mut self) {
        loop {
            let watching = self.lost.watching();
            let Some(n) = queue_events::wait(&self.epoll, &mut self.events, watching, "net") else {
                return;
            };
            if !self.handle(n) {
                return;
            }
        }
    }

    /// Handle the first `n` of the events just waited for (none: a timed check); false once
    /// the device stopped.
    fn handle(&mut self, n: usize) -> bool {
        let mut g = self.state.lock().unwrap();
        if g.stopped {
            return false;
        }
        for ev in &self.events[..n] {
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
        if let Some(resent) = self.lost.check(g.irq.as_ref(), g.paused) {
            if resent.is_power_of_two() {
                tracing::warn!(
                    resent,
                    "net: interrupt not acknowledged for {:?}; sent it again",
                    LostIrqs::RESEND_AFTER
                );
            }
        }
        true
    }
}

impl DeviceLoop for Pump {
    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the epoll lives as long as self.
        unsafe { BorrowedFd::borrow_raw(self.epoll.as_raw_fd()) }
    }

    fn first_wait(&self) -> Duration {
        queue_events::wait_timeout(self.lost.watching())
    }

    fn turn(&mut self) -> Option<Duration> {
        let n = queue_events::ready(&self.epoll, &mut self.events, "net")?;
        self.handle(n)
            .then(|| queue_events::wait_timeout(self.lost.watching()))
    }
}
