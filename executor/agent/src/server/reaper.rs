//! Child ownership and orphan reaping.
//!
//! As PID 1 the agent inherits every orphan and must reap them, but a blanket
//! `waitpid(-1)` would steal the exit statuses that Exec and the Python driver
//! wait for. So every child the agent starts is registered as *owned* (under
//! the same lock that guards the spawn, so a fast-exiting child cannot be
//! reaped before it is registered), and the reaper, woken by SIGCHLD, only
//! collects the children that are not owned.

use std::collections::BTreeMap;
use std::io;
use std::ops::{Deref, DerefMut};
use std::path::Path;
use std::process::{Child, Command};
use std::sync::{Mutex, MutexGuard};

/// Owned children by pid, with how many handles hold each: a pid waited for by its owner can
/// be reused by a new owned child before the old handle is dropped, and that drop must not
/// disown the new child.
static OWNED: Mutex<BTreeMap<i32, usize>> = Mutex::new(BTreeMap::new());

fn owned() -> MutexGuard<'static, BTreeMap<i32, usize>> {
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
    *set.entry(child.id() as i32).or_default() += 1;
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
        let mut set = owned();
        // Its owner gives up the status. If the child has already exited, its SIGCHLD came
        // while it was owned and the reaper left it, and no other signal may ever come: collect
        // it now. (A child already waited for is not waited again: std keeps its status.) If it
        // runs on, its exit's SIGCHLD finds it unowned.
        let _ = self.child.try_wait();
        let pid = self.child.id() as i32;
        if let Some(n) = set.get_mut(&pid) {
            *n -= 1;
            if *n == 0 {
                set.remove(&pid);
            }
        }
    }
}

/// Reaps zombie children that nobody owns; returns how many were reaped.
pub fn reap_orphans() -> usize {
    let set = owned();
    let mut reaped = 0;
    for pid in children().into_iter().filter(|p| !set.contains_key(p)) {
        let mut status = 0;
        // SAFETY: plain syscall on our own child that nobody owns, so no one else waits for
        // it; one still running is left (WNOHANG).
        if unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) } == pid {
            reaped += 1;
        }
    }
    reaped
}

/// This process's children. Each thread's `children` file lists those it forked (and, for
/// the main thread, the orphans given to us); that reads a few small files. Without it
/// (CONFIG_PROC_CHILDREN) every process in /proc is looked at instead, which allocates kernel
/// objects for each and writes to every task: in a clone, memory copied from its parent.
fn children() -> Vec<i32> {
    from_children_files().unwrap_or_else(|| {
        static SAID: std::sync::Once = std::sync::Once::new();
        SAID.call_once(|| {
            eprintln!(
                "tine-agent: no /proc/self/task/*/children (CONFIG_PROC_CHILDREN): the reaper \
                 looks through all of /proc, which writes memory a clone shares"
            )
        });
        from_proc_scan()
    })
}

fn from_children_files() -> Option<Vec<i32>> {
    let main = std::path::PathBuf::from(format!("/proc/self/task/{}", std::process::id()));
    if !main.join("children").exists() {
        return None;
    }
    let mut pids = Vec::new();
    let mut read = |task: &Path| {
        // A thread that has just exited has no file left.
        if let Ok(list) = std::fs::read_to_string(task.join("children")) {
            pids.extend(
                list.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
    };
    // The main thread's last: the children of a thread that exits move to it, with no signal,
    // so children that move while the others are read are still found.
    for task in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        if task.path() != main {
            read(&task.path());
        }
    }
    read(&main);
    Some(pids)
}

fn from_proc_scan() -> Vec<i32> {
    let me = std::process::id() as i32;
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                return false;
            };
            // Fields after the parenthesised command name: state, ppid, ...
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1));
            ppid.and_then(|p| p.parse::<i32>().ok()) == Some(me)
        })
        .collect()
}

/// Blocks SIGCHLD in the calling thread; call before any thread is spawned so
/// every thread inherits the mask and the reaper can `sigwaitinfo` for it.
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

/// Starts the reaper thread: it wakes only on SIGCHLD. It never polls: a clone that idles
/// must not wake, or each pass writes pages it would otherwise share with its parent (a
/// dropped child that has already exited is collected by its handle's drop instead).
pub fn start_reaper() -> io::Result<()> {
    std::thread::Builder::new()
        .name("reaper".into())
        .spawn(|| loop {
            wait_sigchld();
            // Until a pass finds nothing: a list read while children come and go can miss one,
            // and the signal that announced it is already taken.
            while reap_orphans() > 0 {}
        })?;
    Ok(())
}

fn wait_sigchld() {
    // SAFETY: sigset on a local; sigwaitinfo only reads it (and may write no info: null).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        libc::sigwaitinfo(&set, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The children files and the /proc scan both find a child.
    #[test]
    fn both_ways_of_listing_children_find_a_child() {
        let Some(_) = from_children_files() else {
            eprintln!("skipped: this kernel has no CONFIG_PROC_CHILDREN");
            return;
        };
        let mut child = spawn_owned(
            Command::new("sleep")
                .arg("30")
                .stdin(std::process::Stdio::null()),
        )
        .unwrap();
        let pid = child.id() as i32;
        let files = from_children_files().expect("checked above");
        let scan = from_proc_scan();
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(files.contains(&pid), "{files:?} lacks {pid}");
        assert!(scan.contains(&pid), "{scan:?} lacks {pid}");
    }
}
