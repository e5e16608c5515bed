//! Readiness of a restored child: its agent answers, then the clone gets its own wall clock
//! and RNG state. "Spawned" in Tine means exactly this.

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use tine_agent::client::{AgentClient, Connector};

use crate::vms;

/// A client for the agent behind a VM's vsock socket.
pub fn agent(sock: &Path) -> AgentClient {
    AgentClient::new(Connector::vsock(sock))
}

/// Wait for a child's agent, then fix what a clone must not share: wall clock and RNG.
pub fn make_ready(
    dir: &Path,
    pid: u32,
    started: std::fs::File,
    timeout: Duration,
) -> Result<(), String> {
    let log = || std::fs::read_to_string(dir.join("vmm.log")).unwrap_or_default();
    // Block until the child restored its VM (no polling while it works): one byte, or EOF if
    // the child failed first.
    if !wait_byte(&started, timeout)? {
        return Err(format!("child VMM failed to restore: {}", log().trim()));
    }
    let deadline = Instant::now() + timeout;
    // Every agent call may take until the readiness deadline: on an overloaded host (100
    // children on two cores) a reseed can legitimately take tens of seconds.
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1))
    };
    let client = agent(&dir.join("vsock.sock")).with_io_timeout(Some(left()));
    loop {
        // The agent's listener survived the snapshot, so the first ping normally succeeds as
        // soon as the guest runs; retries only cover a guest that is slow to get there.
        match client.wait_ready_polling(
            Duration::from_secs(5),
            Duration::from_millis(1),
            Duration::from_millis(20),
        ) {
            Ok(_) => break,
            Err(e) => {
                if !vms::alive(pid) {
                    return Err(format!("child VMM exited: {}", log().trim()));
                }
                if Instant::now() > deadline {
                    return Err(format!("not ready after {timeout:?}: {e}"));
                }
            }
        }
    }
    let client = client.with_io_timeout(Some(left()));
    client
        .set_time(SystemTime::now())
        .map_err(|e| format!("set_time: {e}"))?;
    let mut seed = [0u8; 64];
    getrandom::fill(&mut seed).map_err(|e| format!("getrandom: {e}"))?;
    client.reseed(&seed).map_err(|e| format!("reseed: {e}"))?;
    Ok(())
}

/// Wait up to `timeout` for one byte on `f`: Ok(true) for the byte, Ok(false) at EOF.
pub fn wait_byte(f: &std::fs::File, timeout: Duration) -> Result<bool, String> {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: f.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe {
        libc::poll(
            &mut pfd,
            1,
            timeout.as_millis().min(i32::MAX as u128) as i32,
        )
    };
    if n == 0 {
        return Err(format!("child VMM did not restore within {timeout:?}"));
    }
    let mut b = [0u8; 1];
    Ok(matches!((&*f).read(&mut b), Ok(1)))
}
