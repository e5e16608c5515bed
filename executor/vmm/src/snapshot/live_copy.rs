//! The memory half of a live branch: fork this (VMM) process while the guest is paused, let the
//! guest run on in the parent at once, and write the pages from the fork. fork(2) gives the
//! child the parent's private pages copy-on-write, so the child sees guest memory exactly as it
//! was at the fork however the guest writes afterwards (KVM drops its writable mappings of the
//! pages fork write-protects, so a guest write after the fork faults and gets its own copy).
//! Which pages were written since the restore is read from the child's own pagemap, so that scan
//! is outside the pause too.
//!
//! The child runs only this copy: it allocates (glibc's malloc is made safe across fork) but
//! takes no other lock, logs nothing, and leaves with `_exit`, reporting through a pipe (not a
//! file: a copy that failed for want of disk space must still be able to say so).

use std::io::Read;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use super::diff;
use crate::memory::GuestRam;
use crate::vm::SnapshotKind;

/// Longest a copy may take before the fork is killed (a large FULL image on a slow disk).
const COPY_TIMEOUT: Duration = Duration::from_secs(600);

/// Fork, call `resumed` in the parent as soon as the fork exists (the guest may run), wait for
/// the fork to write `kind` of `ram` into `dir`, and return the pages written since restore.
pub fn fork_and_copy(
    ram: &GuestRam,
    kind: SnapshotKind,
    since: &[diff::PageRun],
    dir: &Path,
    resumed: impl FnOnce(),
) -> std::io::Result<u64> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills the two descriptors; close-on-exec keeps them out of anything the
    // VMM may exec meanwhile.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        let e = std::io::Error::last_os_error();
        resumed();
        return Err(e);
    }
    // SAFETY: both descriptors were just created and are owned here alone.
    let (report_rx, report_tx) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: getpid has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the child only runs `copy` (allocation, file I/O, pagemap reads: no locks other
    // than malloc's, which glibc re-initialises in the child) and then `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        let e = std::io::Error::last_os_error();
        resumed();
        return Err(e);
    }
    if pid == 0 {
        // A VMM killed mid-copy takes its copy along (its half-written files are never
        // renamed into place; the host sweeps them).
        // SAFETY: prctl and getppid on ourselves.
        unsafe {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != parent {
                libc::_exit(3);
            }
        }
        let code = match copy(ram, kind, since, dir) {
            Ok(pages) => report(&report_tx, &format!("ok {pages}")).map_or(2, |()| 0),
            Err(e) => {
                let _ = report(&report_tx, &format!("error {e}"));
                1
            }
        };
        // SAFETY: leaving the forked child without running the parent's destructors or
        // atexit handlers.
        unsafe { libc::_exit(code) };
    }
    drop(report_tx);
    resumed();
    let waited = wait(pid);
    // The fork has exited: its report (one short write) is in the pipe, or there is none.
    let mut said = String::new();
    let _ = std::fs::File::from(report_rx).read_to_string(&mut said);
    let code = waited?;
    match said.split_once(' ') {
        Some(("ok", n)) if code == 0 => n
            .trim()
            .parse()
            .map_err(|_| std::io::Error::other(format!("the copy reported {said:?}"))),
        Some(("error", e)) => Err(std::io::Error::other(e.trim().to_string())),
        _ => Err(std::io::Error::other(format!(
            "the copying fork exited with status {code} without a report"
        ))),
    }
}

/// `since`: pages a diff must hold besides the private ones (mapped since its parent).
fn copy(
    ram: &GuestRam,
    kind: SnapshotKind,
    since: &[diff::PageRun],
    dir: &Path,
) -> std::io::Result<u64> {
    let private = diff::private_runs(ram)?;
    let written = match kind {
        SnapshotKind::Diff => {
            let written = diff::union(&private, since);
            diff::write_diff_files(ram, &written, dir)?;
            written
        }
        SnapshotKind::Full => {
            diff::flatten(ram, &private, &dir.join(super::file::MEMORY_FILE))?;
            private
        }
    };
    Ok(diff::page_count(&written))
}

/// One write, shorter than PIPE_BUF: atomic, and never blocks on an empty pipe.
fn report(fd: &OwnedFd, what: &str) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let bytes = &what.as_bytes()[..what.len().min(libc::PIPE_BUF - 1)];
    // SAFETY: writing from a valid buffer to our own pipe.
    let n = unsafe { libc::write(fd.as_raw_fd(), bytes.as_ptr().cast(), bytes.len()) };
    if n as usize == bytes.len() {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Reap the fork; kill it if it outlives [`COPY_TIMEOUT`]. Returns its exit code.
fn wait(pid: libc::pid_t) -> std::io::Result<i32> {
    let t0 = Instant::now();
    loop {
        let mut st = 0;
        // SAFETY: waiting for our own child.
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WNOHANG) };
        if r == pid {
            if libc::WIFEXITED(st) {
                return Ok(libc::WEXITSTATUS(st));
            }
            return Err(std::io::Error::other(format!(
                "the copying fork died (wait status {st:#x})"
            )));
        }
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return Err(e);
        }
        if t0.elapsed() > COPY_TIMEOUT {
            // SAFETY: our own child; reaped right after.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut st, 0);
            }
            return Err(std::io::Error::other(format!(
                "the copy took longer than {COPY_TIMEOUT:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}
