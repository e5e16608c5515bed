//! One process per data directory: an exclusive `flock` on a lock file that holds the
//! holder's pid, so a second process is refused with a name to look for. The kernel drops the
//! lock when the holder exits, crashes included; the pid left in the file is then stale and
//! harmless (the next holder overwrites it).

use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// Held for as long as it lives.
#[derive(Debug)]
pub struct PidLock {
    file: std::fs::File,
}

impl Drop for PidLock {
    /// Unlock explicitly rather than by closing: a child forked by another thread and not yet
    /// exec'd shares the open file, and with it the lock, until it execs.
    fn drop(&mut self) {
        // SAFETY: flock on a descriptor we own.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// Another process holds it; `pid` is what it wrote (None: it has not yet).
    #[error("{} is locked by pid {}", path.display(), holder(*pid))]
    Held { path: PathBuf, pid: Option<u32> },
}

/// A holder's pid as said in errors.
pub fn holder(pid: Option<u32>) -> String {
    pid.map_or_else(|| "unknown".into(), |p| p.to_string())
}

/// Lock `dir/name` (made mode 0600 if missing) and write our pid into it.
pub fn lock(dir: &Path, name: &str) -> Result<PidLock, LockError> {
    let path = dir.join(name);
    let io = |source| LockError::Io {
        path: path.clone(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(io)?;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io(err));
        }
        let mut text = String::new();
        let _ = file.read_to_string(&mut text);
        return Err(LockError::Held {
            pid: text.trim().parse().ok(),
            path,
        });
    }
    file.set_len(0).map_err(io)?;
    file.rewind().map_err(io)?;
    writeln!(file, "{}", std::process::id()).map_err(io)?;
    Ok(PidLock { file })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock(dir.path(), "x.lock").unwrap();
        // flock conflicts between open files, even within one process.
        match lock(dir.path(), "x.lock") {
            Err(LockError::Held { pid, .. }) => assert_eq!(pid, Some(std::process::id())),
            other => panic!("{other:?}"),
        }
        drop(first);
        lock(dir.path(), "x.lock").expect("free again once dropped");
    }

    #[test]
    fn a_forked_child_that_has_not_exec_d_does_not_keep_it() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock(dir.path(), "x.lock").unwrap();
        // What another thread's Command::spawn does between fork and exec.
        // SAFETY: the child only calls async-signal-safe functions.
        let child = unsafe { libc::fork() };
        assert!(child >= 0, "fork");
        if child == 0 {
            unsafe {
                libc::sleep(30);
                libc::_exit(0);
            }
        }
        drop(first);
        let again = lock(dir.path(), "x.lock");
        // SAFETY: our own child.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        again.expect("free once dropped though a forked child still shares the file");
    }
}
