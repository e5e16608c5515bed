//! What the event loops of vsock and net share: the queue notification eventfds KVM
//! signals (one per queue, watched in the device's epoll) and the wait that also wakes for
//! the lost-interrupt check.

use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use super::LostIrqs;

/// One notification eventfd per queue (empty without ioeventfds). Not guest state: a
/// restored device gets fresh ones.
#[derive(Default)]
pub struct QueueEvents {
    events: Vec<Arc<EventFd>>,
}

impl QueueEvents {
    /// Watch `events` (one per queue, `queues` of them) in `epoll` under tokens `base + q`.
    /// False, with nothing watched, when already attached, given the wrong count, or refused.
    pub fn attach(
        &mut self,
        epoll: &Epoll,
        events: &[Arc<EventFd>],
        queues: usize,
        base: u64,
        device: &str,
    ) -> bool {
        if !self.events.is_empty() || events.len() != queues {
            return false;
        }
        for (q, e) in events.iter().enumerate() {
            let ev = EpollEvent::new(EventSet::IN, base + q as u64);
            if let Err(err) = epoll.ctl(ControlOperation::Add, e.as_raw_fd(), ev) {
                tracing::warn!("{device}: cannot watch queue {q}'s notification eventfd: {err}");
                for e in &events[..q] {
                    let _ = epoll.ctl(
                        ControlOperation::Delete,
                        e.as_raw_fd(),
                        EpollEvent::default(),
                    );
                }
                return false;
            }
        }
        self.events = events.to_vec();
        true
    }

    /// Consume queue `q`'s notification; true if it was signalled. Non-blocking: another
    /// holder of the device lock (a pause) may have consumed it already.
    pub fn take(&self, q: usize) -> bool {
        self.events
            .get(q)
            .is_some_and(|e| e.read().is_ok_and(|n| n > 0))
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

/// How often an idle device thread wakes to look at its interrupt line.
const IDLE_WAKE: Duration = Duration::from_secs(5);

/// Wait for events: briefly while something is being watched (a pending interrupt), rarely
/// when idle (a hundred idle VMMs should not keep the host awake), never forever (an
/// interrupt raised from a vCPU thread must still be checked). None when epoll itself failed.
pub fn wait(
    epoll: &Epoll,
    events: &mut [EpollEvent],
    watching: bool,
    device: &str,
) -> Option<usize> {
    epoll_wait(epoll, events, wait_timeout(watching), device)
}

/// How long [`wait`] waits.
pub fn wait_timeout(watching: bool) -> Duration {
    if watching {
        LostIrqs::RESEND_AFTER / 2
    } else {
        IDLE_WAKE
    }
}

/// The events ready now, without waiting (a loop turned by its VM's owner, who waited).
pub fn ready(epoll: &Epoll, events: &mut [EpollEvent], device: &str) -> Option<usize> {
    epoll_wait(epoll, events, Duration::ZERO, device)
}

fn epoll_wait(
    epoll: &Epoll,
    events: &mut [EpollEvent],
    timeout: Duration,
    device: &str,
) -> Option<usize> {
    match epoll.wait(timeout.as_millis() as i32, events) {
        Ok(n) => Some(n),
        Err(e) if e.kind() == ErrorKind::Interrupted => Some(0),
        Err(e) => {
            tracing::error!("{device}: epoll failed: {e}");
            None
        }
    }
}
