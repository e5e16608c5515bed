//! Which process a VM runs in, in a form that survives pid reuse. A bare pid is not an
//! identity: after a daemon restart (or a host reboot) the pid in a VM's record may belong to
//! an unrelated process. A record therefore keeps the pid together with the process's start
//! time (in clock ticks since boot) and the kernel's boot id, and signals go through a pidfd
//! opened and then checked against both, so the process signalled is the one recorded.

use std::os::fd::{FromRawFd, OwnedFd};

use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessIdentity {
    pub pid: u32,
    /// Field 22 of /proc/PID/stat.
    pub start_ticks: u64,
    /// /proc/sys/kernel/random/boot_id when the record was made.
    pub boot_id: String,
}

/// What became of a recorded process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Liveness {
    Running,
    /// Exited (or a zombie waiting to be reaped).
    Exited,
    /// The pid runs, but it is another process (pid reused, or a different boot).
    Replaced,
}

pub fn boot_id() -> std::io::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?
        .trim()
        .to_string())
}

/// A /proc/PID/stat line split into its command name and the fields after it (the first
/// is field 3, the state). The name is parenthesised and may itself hold spaces and
/// parentheses, so it ends at the last `)`.
pub fn stat_fields(text: &str) -> Option<(&str, Vec<&str>)> {
    let (head, rest) = text.rsplit_once(')')?;
    let (_, comm) = head.split_once('(')?;
    Some((comm, rest.split_whitespace().collect()))
}

/// Clock ticks (the unit of /proc's CPU times) in ms; None if the tick rate is unknown.
pub fn ticks_to_ms(ticks: u64) -> Option<f64> {
    // SAFETY: sysconf has no memory effects.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| ticks as f64 * 1e3 / hz as f64)
}

/// (state letter, start time) from /proc/PID/stat, or None if there is no such process.
fn stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, fields) = stat_fields(&text)?;
    // Fields start at field 3 (state); start time is field 22.
    let state = fields.first()?.chars().next()?;
    let start = fields.get(22 - 3)?.parse().ok()?;
    Some((state, start))
}

/// The parent pid of `pid`, from /proc (None once it is gone).
pub fn parent_of(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, fields) = stat_fields(&text)?;
    // Fields start at field 3 (state); the parent is field 4.
    fields.get(1)?.parse().ok()
}

impl ProcessIdentity {
    /// The identity of the running process `pid`.
    pub fn of(pid: u32) -> std::io::Result<ProcessIdentity> {
        let (_, start_ticks) = stat(pid).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, format!("no process {pid}"))
        })?;
        Ok(ProcessIdentity {
            pid,
            start_ticks,
            boot_id: boot_id()?,
        })
    }

    pub fn liveness(&self) -> Liveness {
        if boot_id().ok().as_deref() != Some(self.boot_id.as_str()) {
            // Recorded in an earlier boot: whatever has this pid now is not ours.
            return match stat(self.pid) {
                Some(_) => Liveness::Replaced,
                None => Liveness::Exited,
            };
        }
        match stat(self.pid) {
            None => Liveness::Exited,
            Some((_, start)) if start != self.start_ticks => Liveness::Replaced,
            Some(('Z' | 'X', _)) => Liveness::Exited,
            Some(_) => Liveness::Running,
        }
    }

    /// Whether the recorded process runs with `arg` among its arguments (a record on disk
    /// names a process: only one that is what the record says may be signalled).
    pub fn runs(&self, arg: &str) -> bool {
        std::fs::read(format!("/proc/{}/cmdline", self.pid))
            .map(|c| c.split(|b| *b == 0).any(|a| a == arg.as_bytes()))
            .unwrap_or(false)
            && self.liveness() == Liveness::Running
    }

    /// SIGKILL the recorded process if it still runs. Returns whether it was signalled; a
    /// replaced pid is never signalled.
    pub fn kill(&self) -> std::io::Result<bool> {
        let pidfd = match pidfd_open(self.pid) {
            Ok(fd) => fd,
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => return Ok(false),
            Err(e) => return Err(e),
        };
        // The pidfd pins the process it was opened on; checking the identity after opening
        // makes sure that process is the recorded one.
        if self.liveness() != Liveness::Running {
            return Ok(false);
        }
        let r = pidfd_kill(&pidfd);
        use std::os::fd::AsRawFd;
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ESRCH) => Ok(false),
                _ => Err(e),
            };
        }
        // The pidfd turns readable once the process has exited: wait for that (briefly), so
        // its files and memory are released when we return.
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, 2000) };
        Ok(true)
    }
}

/// A VMM worker process of ours, to signal and reap: one this process started, or one it
/// adopted (a worker forked by the zygote is orphaned at once and comes to this process as
/// the subreaper, see [`crate::zygote`]). Unlike std's `Child` it can be made from a pid. Its
/// pid cannot be reused while it is not reaped, so signalling it by pid is safe until then.
#[derive(Debug)]
pub struct VmmProcess {
    pid: u32,
    /// Set once reaped.
    status: Option<std::process::ExitStatus>,
}

impl VmmProcess {
    /// A child std started (its handle is dropped: this type reaps it).
    pub fn started(child: std::process::Child) -> VmmProcess {
        VmmProcess {
            pid: child.id(),
            status: None,
        }
    }

    /// A process that is this process's child, by adoption. The caller has checked that.
    pub(crate) fn adopted(pid: u32) -> VmmProcess {
        VmmProcess { pid, status: None }
    }

    pub fn id(&self) -> u32 {
        self.pid
    }

    /// SIGKILL it, unless it has been reaped already.
    pub fn kill(&mut self) -> std::io::Result<()> {
        if self.status.is_some() {
            return Ok(());
        }
        // SAFETY: kill takes a pid and a signal; the pid is our unreaped child's.
        if unsafe { libc::kill(self.pid as libc::pid_t, libc::SIGKILL) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Wait for it to exit and reap it.
    pub fn wait(&mut self) -> std::io::Result<std::process::ExitStatus> {
        loop {
            if let Some(s) = self.reap(0)? {
                return Ok(s);
            }
        }
    }

    /// Reap it if it has exited.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.reap(libc::WNOHANG)
    }

    fn reap(&mut self, flags: libc::c_int) -> std::io::Result<Option<std::process::ExitStatus>> {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = self.status {
            return Ok(Some(s));
        }
        let mut raw = 0;
        // SAFETY: waitpid on our own child's pid, into a local.
        let r = unsafe { libc::waitpid(self.pid as libc::pid_t, &mut raw, flags) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            return match e.kind() {
                std::io::ErrorKind::Interrupted => Ok(None),
                _ => Err(e),
            };
        }
        if r == 0 {
            return Ok(None);
        }
        let s = std::process::ExitStatus::from_raw(raw);
        self.status = Some(s);
        Ok(Some(s))
    }
}

/// A pidfd for `pid`: it pins that process, and turns readable once it exits.
pub fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_int, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// SIGKILL the process behind `pidfd`; the raw syscall result (negative: see errno).
pub fn pidfd_kill(pidfd: &OwnedFd) -> libc::c_long {
    use std::os::fd::AsRawFd;
    // SAFETY: pidfd_send_signal on our own pidfd with no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0u32,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_reused_pid_is_not_the_recorded_process() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let id = ProcessIdentity::of(child.id()).unwrap();
        assert_eq!(id.liveness(), Liveness::Running);
        // The same pid with another start time stands for a process that was replaced.
        let other = ProcessIdentity {
            start_ticks: id.start_ticks + 1,
            ..id.clone()
        };
        assert_eq!(other.liveness(), Liveness::Replaced);
        assert!(
            !other.kill().unwrap(),
            "a replaced pid must not be signalled"
        );
        let earlier_boot = ProcessIdentity {
            boot_id: "00000000-0000-0000-0000-000000000000".into(),
            ..id.clone()
        };
        assert_eq!(earlier_boot.liveness(), Liveness::Replaced);
        assert!(!earlier_boot.kill().unwrap());
        assert_eq!(id.liveness(), Liveness::Running, "still untouched");
        assert!(id.kill().unwrap());
        let status = child.wait().unwrap();
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
        assert_eq!(id.liveness(), Liveness::Exited);
        assert!(!id.kill().unwrap());
    }
}
