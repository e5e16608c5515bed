//! On-demand state dumps for diagnosing stalls: `kill -USR1 <vmm pid>` makes every device that
//! keeps diagnosable state (today the vsock devices) log it once.
//!
//! The signal handler is process-wide, so the VMM installs it when a VM starts
//! ([`crate::vm::Vm::start`]) and devices never touch signal dispositions: a device only holds a
//! [`DumpRequests`] cursor and looks at it from its own thread.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// Requests so far; each device remembers how many it has served, so one signal reaches all.
static REQUESTS: AtomicU64 = AtomicU64::new(0);

/// Ask every device to log its state once (what SIGUSR1 does).
pub fn request_state_dump() {
    REQUESTS.fetch_add(1, Ordering::SeqCst);
}

extern "C" fn on_sigusr1(_: libc::c_int) {
    // A lock-free atomic add: async-signal-safe.
    request_state_dump();
}

/// Make SIGUSR1 request a state dump; idempotent. [`crate::vm::Vm::start`] calls it; a program
/// that runs devices without a [`crate::vm::Vm`] can call it itself.
pub fn install_state_dump_signal() -> std::io::Result<()> {
    static ONCE: OnceLock<Option<i32>> = OnceLock::new();
    let failed = ONCE.get_or_init(|| {
        // SAFETY: a zeroed sigaction is a valid "no flags, empty mask" value; the handler only
        // touches an atomic. SA_RESTART keeps blocking calls in other threads from failing
        // with EINTR when the signal lands on them.
        unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = on_sigusr1 as *const () as libc::sighandler_t;
            act.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut act.sa_mask);
            if libc::sigaction(libc::SIGUSR1, &act, std::ptr::null_mut()) != 0 {
                return std::io::Error::last_os_error().raw_os_error();
            }
        }
        None
    });
    match failed {
        Some(errno) => Err(std::io::Error::from_raw_os_error(*errno)),
        None => Ok(()),
    }
}

/// One device's view of the dump requests.
pub struct DumpRequests {
    served: u64,
}

impl Default for DumpRequests {
    /// Requests made before the device existed are not its concern.
    fn default() -> Self {
        Self {
            served: REQUESTS.load(Ordering::SeqCst),
        }
    }
}

impl DumpRequests {
    /// True once if a dump was requested since the last call.
    pub fn take(&mut self) -> bool {
        let now = REQUESTS.load(Ordering::SeqCst);
        std::mem::replace(&mut self.served, now) != now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_device_sees_each_request_once() {
        let mut a = DumpRequests::default();
        let mut b = DumpRequests::default();
        assert!(!a.take());
        request_state_dump();
        assert!(a.take() && !a.take());
        assert!(b.take() && !b.take(), "one request reaches every device");
    }

    #[test]
    fn sigusr1_requests_a_dump() {
        install_state_dump_signal().unwrap();
        let mut d = DumpRequests::default();
        // SAFETY: raising a signal whose handler was just installed.
        unsafe { libc::raise(libc::SIGUSR1) };
        assert!(d.take());
    }
}
