//! The device's event loop: waits on the host streams and the queue notification eventfds
//! (epoll), hands stream events to the muxer, drains the transmit queue when the guest notifies
//! it, fills the guest's receive queue, and runs the watchdog that recovers from lost
//! interrupts and reports work that stays stuck. Run on a thread of the device's own
//! ([`Pump::run`]) or turned by the VM's owner ([`DeviceLoop`]).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{Epoll, EpollEvent};

use super::device::{DeviceState, TOKEN_QUEUE_BASE, TOKEN_STOP};
use super::dump;
use super::muxer::TOKEN_LISTENER;
use crate::devices::virtio::{queue_events, DeviceLoop, LostIrqs, INT_USED_RING};
use crate::diagnostics::DumpRequests;

pub(super) struct Pump {
    state: Arc<Mutex<DeviceState>>,
    epoll: Arc<Epoll>,
    events: Vec<EpollEvent>,
    watchdog: IrqWatchdog,
    /// Something pending that the next checks must follow closely.
    busy: bool,
}

impl Pump {
    pub(super) fn new(state: Arc<Mutex<DeviceState>>, epoll: Arc<Epoll>) -> Pump {
        Pump {
            state,
            epoll,
            events: vec![EpollEvent::default(); 64],
            watchdog: IrqWatchdog::default(),
            busy: false,
        }
    }

    /// The device's own thread.
    pub(super) fn run(mut self) {
        loop {
            let Some(n) = queue_events::wait(&self.epoll, &mut self.events, self.busy, "vsock")
            else {
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
                TOKEN_LISTENER => {
                    g.first_call.mark("host connected");
                    g.muxer.accept()
                }
                TOKEN_STOP => {}
                t if t >= TOKEN_QUEUE_BASE => {
                    let q = (t - TOKEN_QUEUE_BASE) as usize;
                    // Already consumed (a pause drained it): nothing new to look at.
                    if g.queue_events.take(q) {
                        g.on_queue_notify(q);
                    }
                }
                t => g.muxer.on_stream_event(t, ev.event_set()),
            }
        }
        g.process_rx();
        // One interrupt for the whole pass, before the watchdog looks for a lost one.
        g.flush_irq();
        self.watchdog.check(&mut g);
        g.flush_irq();
        self.busy = self.watchdog.watching();
        true
    }
}

impl DeviceLoop for Pump {
    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the epoll lives as long as self.
        unsafe { BorrowedFd::borrow_raw(self.epoll.as_raw_fd()) }
    }

    fn first_wait(&self) -> Duration {
        queue_events::wait_timeout(self.busy)
    }

    fn turn(&mut self) -> Option<Duration> {
        let n = queue_events::ready(&self.epoll, &mut self.events, "vsock")?;
        self.handle(n)
            .then(|| queue_events::wait_timeout(self.busy))
    }
}

/// Recovery and diagnosis for stalls the device cannot see directly: lost interrupts (see
/// [`LostIrqs`]); a connection blocked on guest credit asks for a credit update instead of
/// waiting for one forever; and work that stays pending is logged with the device state.
#[derive(Default)]
struct IrqWatchdog {
    lost: LostIrqs,
    stuck_since: Option<Instant>,
    stuck_reports: u32,
    credit_asked: HashMap<u64, Instant>,
    dumps: DumpRequests,
}

impl IrqWatchdog {
    /// Something is pending that the next checks must follow closely.
    fn watching(&self) -> bool {
        self.lost.watching() || self.stuck_since.is_some() || !self.credit_asked.is_empty()
    }

    fn check(&mut self, g: &mut DeviceState) {
        if self.dumps.take() {
            tracing::warn!("vsock state (SIGUSR1): {}", dump::describe(g));
        }
        let resent = self.lost.check(g.irq.as_ref(), g.paused);
        if g.paused || g.irq.is_none() {
            return;
        }
        if let Some(resent) = resent.filter(|n| n.is_power_of_two()) {
            tracing::warn!(
                resent,
                "vsock: interrupt not acknowledged for {:?}; sent it again; {}",
                LostIrqs::RESEND_AFTER,
                dump::describe(g)
            );
        }
        let now = Instant::now();
        // Connections with host data waiting on guest credit: ask for an update.
        let blocked = g.muxer.credit_starved();
        self.credit_asked.retain(|t, _| blocked.contains(t));
        let mut asked = false;
        for t in blocked {
            let due = self
                .credit_asked
                .get(&t)
                .is_none_or(|at| now.duration_since(*at) >= LostIrqs::RESEND_AFTER);
            if due && g.muxer.request_credit(t) {
                self.credit_asked.insert(t, now);
                asked = true;
            }
        }
        if asked {
            g.process_rx();
        }
        // Work that cannot get out (control packets queued, or requests unanswered): say so
        // with the state, at 3 s and then at doubling intervals.
        if !g.muxer.awaiting_guest() {
            self.stuck_since = None;
            self.stuck_reports = 0;
        } else {
            let since = *self.stuck_since.get_or_insert(now);
            let due = Duration::from_secs(3) * (1u32 << self.stuck_reports.min(8));
            if now.duration_since(since) >= due {
                self.stuck_reports += 1;
                tracing::warn!(
                    "vsock: work pending for {:.1} s; {}",
                    now.duration_since(since).as_secs_f64(),
                    dump::describe(g)
                );
                // A guest that acknowledged but never refilled its receive ring: nudge it.
                if let Some(irq) = &g.irq {
                    irq.trigger(INT_USED_RING);
                }
            }
        }
    }
}
