//! Readiness of a restored child: its VMM restored the snapshot, and its agent answered the
//! call that gives the clone its own wall clock, RNG state and identity. "Spawned" in Tine
//! means exactly this. (The warm interpreter's generators are reseeded before its next eval.)

use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use tine_agent::client::{
    AgentClient, AnswerWait, ClientError, CloneIdentity, Connector, Readiness as AgentReadiness,
};

use crate::config::Readiness;
use crate::error::{HostError, Result};
use crate::process::{Liveness, ProcessIdentity};
use crate::worker::Restored;

/// A client for the agent behind a VM's vsock socket.
pub fn agent(sock: &Path) -> AgentClient {
    AgentClient::new(Connector::vsock(sock))
}

/// Where a child's readiness time went (also the executor's spawn-phase metrics).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpawnPhases {
    /// Its network namespace taken from the pool (or made) and its policy applied.
    pub network: Duration,
    /// Child directory + record, a worker taken from the pool and handed the job.
    pub handoff: Duration,
    /// The worker's `Vm::restore` (KVM VM, memory mapping, vCPU + device state).
    pub restore: Duration,
    /// vCPUs started and the "restored" report back to the host.
    pub running: Duration,
    /// First answer from the guest agent. Agents that know Wake set the wall clock, take
    /// fresh entropy and the clone's identity in that same exchange.
    pub agent: Duration,
    /// Wall clock set and RNG reseeded in separate calls: only for agents before Wake (or a
    /// clone still warming up), otherwise about zero.
    pub fixup: Duration,
    /// All of it, as the caller saw it.
    pub total: Duration,
    /// Wake connections the host opened to the agent until its first answer (1 when the
    /// first was answered; 0 when readiness did not wait for the agent). A child that never
    /// became ready reports no phases, so these are of ready children only.
    pub agent_attempts: u32,
}

impl SpawnPhases {
    /// (name, duration) of each phase in order, then the total: the one list the metrics
    /// and the benchmark table both use.
    pub fn named(&self) -> [(&'static str, Duration); 7] {
        [
            ("network", self.network),
            ("handoff", self.handoff),
            ("restore", self.restore),
            ("running", self.running),
            ("agent", self.agent),
            ("fixup", self.fixup),
            ("total", self.total),
        ]
    }
}

/// The last lines of a child's vmm.log, on one line.
pub(crate) fn vmm_log(dir: &Path) -> String {
    let log = std::fs::read_to_string(dir.join("vmm.log")).unwrap_or_default();
    let tail: Vec<&str> = log.lines().rev().take(5).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
}

/// Wait for a handed-off child to restore, then make it ready. `phases.handoff` is filled in
/// by the caller; this fills in the rest (but `total`).
pub fn make_ready(
    dir: &Path,
    process: &ProcessIdentity,
    restored_pipe: std::fs::File,
    readiness: Readiness,
    timeout: Duration,
    phases: &mut SpawnPhases,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let t0 = Instant::now();
    // Block until the child restored its VM (no polling while it works): its report, or EOF
    // if it failed first.
    let restored = {
        let _s = tracing::info_span!("spawn.restore").entered();
        wait_restored(&restored_pipe, timeout)?
            .ok_or_else(|| HostError::RestoreFailed { log: vmm_log(dir) })?
    };
    phases.restore = restored.restore;
    phases.running = t0.elapsed().saturating_sub(restored.restore);
    if readiness == Readiness::Running {
        return Ok(());
    }
    // Every agent call may take until the readiness deadline: on an overloaded host (100
    // children on two cores) a reseed can legitimately take tens of seconds.
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1))
    };
    let t1 = Instant::now();
    let client = agent(&dir.join("vsock.sock")).with_io_timeout(Some(left()));
    let (seed, identity) = clone_seed(dir)?;
    // One exchange makes the clone ready: clock, entropy, identity, and what a ping says.
    let woke = {
        let _s = tracing::info_span!("spawn.agent").entered();
        let mut backoff = Duration::from_millis(1);
        loop {
            // The agent's listener survived the snapshot, so the first attempt normally
            // succeeds as soon as the guest runs. It may wait until the deadline: a connection
            // the VMM accepted is one the guest accepted, and the VMM holds it back until the
            // guest has dropped the connections of before the snapshot. So no answer yet means
            // a slow guest, and a second call would only add to its work (each abandoned call
            // is still served, on a thread of its own; docs/performance.md, "Wake retries").
            // A refused or closed connection, or a VMM that died, fails the call at once.
            phases.agent_attempts += 1;
            let answer = client.wake(SystemTime::now(), &seed, identity.as_ref(), left());
            match answer {
                Ok(w) => break Some(w),
                Err(e) if e.is_unknown_request() => break None,
                // An answer that is an error is final; a connection closed before any answer
                // is not (a clone's vsock transport resets as it resumes).
                Err(e @ ClientError::Agent(..)) => {
                    return Err(HostError::Fixup {
                        step: "waking the clone",
                        reason: e.to_string(),
                    })
                }
                // It waited until the deadline (give or take the scheduling of this thread).
                Err(e @ ClientError::NoAnswer(_)) => {
                    return Err(HostError::NotReady {
                        timeout,
                        last: e.to_string(),
                    })
                }
                Err(e) => keep_waiting(process, dir, deadline, timeout, &e)?,
            }
            std::thread::sleep(backoff);
            backoff = (backoff * 2).min(Duration::from_millis(20));
        }
    };
    phases.agent = t1.elapsed();
    let t2 = Instant::now();
    let _s = tracing::info_span!("spawn.fixup").entered();
    match woke {
        Some(w) if w.ping.readiness == AgentReadiness::Ready => {}
        // An agent from before Wake, or a clone whose warm-up is not done (its parent's was,
        // so this is for robustness only): the separate calls, after it reports ready.
        _ => separate_fixups(&client, dir, process, deadline, timeout, &seed, identity)?,
    }
    phases.fixup = t2.elapsed();
    Ok(())
}

/// After a failed attempt to reach a child's agent: Ok to try again, or why not (its VMM
/// exited, or the readiness deadline passed, with `last` as the last failure).
fn keep_waiting(
    process: &ProcessIdentity,
    dir: &Path,
    deadline: Instant,
    timeout: Duration,
    last: &ClientError,
) -> Result<()> {
    if process.liveness() != Liveness::Running {
        return Err(HostError::VmmExited { log: vmm_log(dir) });
    }
    if Instant::now() > deadline {
        return Err(HostError::NotReady {
            timeout,
            last: last.to_string(),
        });
    }
    Ok(())
}

/// 48 bytes of fresh entropy for a clone and, for one with a sandbox directory, its own
/// hostname (its sandbox id) and machine-id (drawn with the seed).
fn clone_seed(dir: &Path) -> Result<([u8; 48], Option<CloneIdentity>)> {
    let mut seed = [0u8; 64];
    getrandom::fill(&mut seed).map_err(|e| HostError::Fixup {
        step: "drawing a seed",
        reason: e.to_string(),
    })?;
    let mut machine_id = [0u8; 16];
    machine_id.copy_from_slice(&seed[48..]);
    let identity = dir
        .file_name()
        .map(|n| CloneIdentity::new(&hostname_of(&n.to_string_lossy()), machine_id));
    let mut entropy = [0u8; 48];
    entropy.copy_from_slice(&seed[..48]);
    Ok((entropy, identity))
}

/// Readiness the way agents before Wake need it: ping until ready, then set the clock, then
/// reseed (which also reseeds the warm interpreter before answering).
fn separate_fixups(
    client: &AgentClient,
    dir: &Path,
    process: &ProcessIdentity,
    deadline: Instant,
    timeout: Duration,
    seed: &[u8],
    identity: Option<CloneIdentity>,
) -> Result<()> {
    // In slices, so a VMM that died is reported as such; each at least as long as the wait a
    // slow guest has earned, which carries across them.
    let mut wait = AnswerWait::default();
    loop {
        let left = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_secs(1));
        match client.wait_ready_paced(
            wait.slice(left),
            Duration::from_millis(1),
            Duration::from_millis(20),
            &mut wait,
        ) {
            Ok(_) => break,
            // A warm-up that failed stays failed: no point polling until the deadline.
            Err(e @ ClientError::WarmupFailed { .. }) => {
                return Err(HostError::Fixup {
                    step: "waiting for the clone's warm-up",
                    reason: e.to_string(),
                })
            }
            Err(e) => keep_waiting(process, dir, deadline, timeout, &e)?,
        }
    }
    client
        .set_time(SystemTime::now())
        .map_err(|e| HostError::Fixup {
            step: "setting the clock",
            reason: e.to_string(),
        })?;
    client
        .reseed(seed, identity.as_ref())
        .map_err(|e| HostError::Fixup {
            step: "reseeding the RNG",
            reason: e.to_string(),
        })?;
    Ok(())
}

/// A hostname for the child with sandbox id `id`: the id, with what a hostname cannot hold
/// (`_`, `+`) made `-`, at most 64 characters.
fn hostname_of(id: &str) -> String {
    let keep = |c: char| c.is_ascii_alphanumeric() || c == '-' || c == '.';
    let name: String = id
        .trim_start_matches(|c: char| !c.is_ascii_alphanumeric())
        .chars()
        .map(|c| if keep(c) { c } else { '-' })
        .take(64)
        .collect();
    if name.is_empty() {
        "tine".to_string()
    } else {
        name
    }
}

/// Wait up to `timeout` for a worker's [`Restored`] report: None at EOF (it failed).
pub(crate) fn wait_restored(f: &std::fs::File, timeout: Duration) -> Result<Option<Restored>> {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; Restored::LEN];
    let mut got = 0;
    while got < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        match read_with_timeout(f, &mut buf[got..], left) {
            Ok(0) => return Ok(None),
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(HostError::RestoreTimeout(timeout))
            }
            Err(e) => return Err(HostError::io("reading the child VMM's report")(e)),
        }
    }
    Ok(Restored::decode(&buf))
}

/// Wait until `fd` is readable (or at end of file), at most `timeout` (then `TimedOut`);
/// interruptions are retried within the same deadline.
pub(crate) fn wait_readable(
    fd: &impl std::os::fd::AsRawFd,
    timeout: Duration,
) -> std::io::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if n > 0 {
            return Ok(());
        }
        if n == 0 {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// One read from `fd` once it is readable, waiting at most `timeout` (then `TimedOut`);
/// interruptions are retried. 0 is end of file.
pub(crate) fn read_with_timeout(
    fd: &impl std::os::fd::AsRawFd,
    buf: &mut [u8],
    timeout: Duration,
) -> std::io::Result<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        wait_readable(fd, deadline.saturating_duration_since(Instant::now()))?;
        // SAFETY: reads into the buffer we own, at most its length.
        let r = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_sandbox_id_makes_a_hostname() {
        assert_eq!(
            super::hostname_of("sbx-1811c74a030833e5"),
            "sbx-1811c74a030833e5"
        );
        assert_eq!(super::hostname_of("a_b+c"), "a-b-c");
        assert_eq!(super::hostname_of(&"x".repeat(128)).len(), 64);
        assert_eq!(super::hostname_of("-_x"), "x");
        assert_eq!(super::hostname_of("__"), "tine");
    }
}
