//! Child ownership and orphan reaping.
//!
//! As PID 1 the agent inherits every orphan and must reap them, but a blanket
//! `waitpid(-1)` would steal the exit statuses that Exec and the Python driver
//! wait for. So every child the agent starts is registered as *owned* (under
//! the same lock that guards the spawn, so a fast-exiting child cannot be
//! reaped before it is registered), and the reaper only collects zombies it
//! finds in /proc whose parent is us and which are not owned.

use std::collections::BTreeSet;
use std::io;
use std::ops::{Deref, DerefMut};
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

static OWNED: Mutex<BTreeSet<i32>> = Mutex::new(BTreeSet::new());

fn owned() -> MutexGuard<'static, BTreeSet<i32>> {
    OWNED.lock().unwrap_or_else(|e| e.into_inner())
}

/// A child whose exit status belongs to whoever holds this handle. Dropping
/// it hands the pid to the reaper.
#[derive(Debug)]
pub struct OwnedChild {
    child: Child,
}

pub fn spawn_owned(cmd: &mut Command) -> io::Result<OwnedChild> {
    let mut set = owned();
    let child = cmd.spawn()?;
    set.insert(child.id() as i32);
    Ok(OwnedChild { child })
}

impl Deref for OwnedChild {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.child
    }
}

impl DerefMut for OwnedChild {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.child
    }
}

impl Drop for OwnedChild {
    fn drop(&mut self) {
        owned().remove(&(self.child.id() as i32));
    }
}

/// Reaps zombie children that nobody owns; returns how many were reaped.
pub fn reap_orphans() -> usize {
    let set = owned();
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut reaped = 0;
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if set.contains(&pid) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the parenthesised command name: state, ppid, ...
        let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let (Some(state), Some(ppid)) = (fields.next(), fields.next()) else {
            continue;
        };
        if state == "Z" && ppid.parse::<i32>() == Ok(me) {
            let mut status = 0;
            // SAFETY: plain syscall on a pid we just saw as our zombie child.
            if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
                reaped += 1;
            }
        }
    }
    reaped
}

/// Blocks SIGCHLD in the calling thread; call before any thread is spawned so
/// every thread inherits the mask and the reaper can `sigtimedwait` for it.
/// (std resets the mask in spawned children.)
pub fn block_sigchld() -> io::Result<()> {
    // SAFETY: sigset manipulation on a local, then pthread_sigmask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
    }
    Ok(())
}

/// Starts the reaper thread: it wakes on SIGCHLD (and every few seconds as a
/// backstop for zombies whose owner dropped them after the signal).
pub fn start_reaper() -> io::Result<()> {
    std::thread::Builder::new()
        .name("reaper".into())
        .spawn(|| loop {
            wait_sigchld(Duration::from_secs(5));
            reap_orphans();
        })?;
    Ok(())
}

fn wait_sigchld(timeout: Duration) {
    // SAFETY: sigset on a local; sigtimedwait only reads it.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        let ts = libc::timespec {
            tv_sec: timeout.as_secs() as libc::time_t,
            tv_nsec: timeout.subsec_nanos() as libc::c_long,
        };
        libc::sigtimedwait(&set, std::ptr::null_mut(), &ts);
    }
}
