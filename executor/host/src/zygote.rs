//! VMM workers forked from one started process, the zygote, instead of each started from the
//! program.
//!
//! Why: the worker is a position-independent executable, so the dynamic loader writes every
//! relocation into its data as the program loads (for `tine-vmm-worker` about 100 KiB of
//! `.data.rel.ro` and `.got`, and the C library's and the loader's own data), and a worker
//! started from the program keeps that private copy for the life of the child it runs. Workers
//! forked from one process that loaded once share those pages with it copy-on-write: they are
//! written at load and only read after.
//!
//! The price: forked workers share their zygote's address-space layout and the C library's
//! stack-protector and pointer-guard values, with it and with each other. A guest reaches only
//! its own VMM, so across tenants this gives nothing; within one tenant, a leak in one VMM and
//! a corruption bug in a sibling could be combined (docs/security.md). A new zygote, with a new
//! layout, is started for every [`FORKS_PER_ZYGOTE`] workers and with every executor.
//! `WorkerStart::Exec` starts every worker from the program instead, each with a layout of its
//! own.
//!
//! How: the pool starts `<worker_exe> __vmm-worker --zygote` with one end of a
//! `SOCK_SEQPACKET` pair as its stdin and stdout, and waits for it to say it serves. Then it
//! sends one message per worker carrying that worker's stdin (a pipe's read end), stdout (its
//! report socket) and, if it has one, its idle cgroup's `cgroup.procs`. The zygote forks a
//! go-between, which moves itself into that cgroup, forks the worker and exits; the orphaned
//! worker is adopted by the pool's process, which is a child subreaper
//! (`PR_SET_CHILD_SUBREAPER`) for the length of that exchange, so the host signals and reaps
//! it as it does a worker it started itself ([`VmmProcess`]). The zygote reaps the go-between
//! and answers with the worker's pid. Nothing of the zygote's is left in the worker: its
//! socket was its stdin and stdout, which the worker's own replace.

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::handoff::{recv_with_fds, send_with_fds};
use crate::process::VmmProcess;

/// The argument after `__vmm-worker` that makes the process a zygote.
pub const ZYGOTE_ARG: &str = "--zygote";

/// Workers one zygote forks before the pool starts a new one (with a new address-space
/// layout). Workers of different zygotes share nothing; 64 keeps nearly all of the saving.
pub const FORKS_PER_ZYGOTE: u32 = 64;

/// How the pool starts a VMM worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerStart {
    /// Forked from a zygote (the default; see the module's doc), or started from the program
    /// where no zygote can be had.
    #[default]
    Fork,
    /// Each started from the program, with an address-space layout of its own.
    Exec,
}

impl std::str::FromStr for WorkerStart {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "fork" => Ok(WorkerStart::Fork),
            "exec" => Ok(WorkerStart::Exec),
            other => Err(format!("{other:?}: expected fork or exec")),
        }
    }
}

impl std::fmt::Display for WorkerStart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WorkerStart::Fork => "fork",
            WorkerStart::Exec => "exec",
        })
    }
}

/// The zygote's first word, once it serves: an older worker program given `--zygote` says
/// the worker's `I` instead, on the same socket.
const HELLO: u8 = b'Z';
/// How long a zygote may take to say it serves (a loaded host starts processes slowly).
const HELLO_TIMEOUT: Duration = Duration::from_secs(30);
/// The pool's request: fork a worker (its stdin, stdout and, if it has one, its cgroup's
/// `cgroup.procs` ride along).
const FORK: u8 = b'F';
/// The zygote's answers: a worker's pid (u32 LE), or an errno (i32 LE) and no worker.
const FORKED: u8 = b'P';
const FAILED: u8 = b'E';
/// How long the pool waits for a fork's answer (a fork takes a millisecond or so).
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// What [`serve`] returns as.
pub enum Role {
    /// The zygote, at its end (its pool went away): exit with this code.
    Exit(i32),
    /// A forked worker, its stdin and stdout in place: run the worker.
    Worker,
}

/// Body of `<worker_exe> __vmm-worker --zygote`: fork a worker for each request on stdin until
/// it closes. Returns in the zygote at the end, and in every worker it forks.
pub fn serve() -> std::io::Result<Role> {
    // SAFETY: fd 0 is the socket the pool started us with; it stays open while we serve.
    let sock = unsafe { BorrowedFd::borrow_raw(0) };
    send(sock, &[HELLO])?;
    loop {
        let (fds, body) = match recv_with_fds(sock, Duration::from_secs(3600), 1) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(Role::Exit(0)),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => continue,
            Err(e) => return Err(e),
        };
        let mut fds = fds.into_iter();
        let answer = match (
            body.as_slice(),
            fds.next(),
            fds.next(),
            fds.next(),
            fds.next(),
        ) {
            ([FORK], Some(stdin), Some(stdout), procs, None) => match fork_worker(procs.as_ref()) {
                Ok(Forked::Worker) => {
                    become_worker(stdin, stdout)?;
                    return Ok(Role::Worker);
                }
                Ok(Forked::Started(pid)) => [&[FORKED][..], &pid.to_le_bytes()].concat(),
                Ok(Forked::Failed(errno)) => [&[FAILED][..], &errno.to_le_bytes()].concat(),
                Err(e) => {
                    let errno = e.raw_os_error().unwrap_or(libc::EIO);
                    [&[FAILED][..], &errno.to_le_bytes()].concat()
                }
            },
            _ => [&[FAILED][..], &libc::EINVAL.to_le_bytes()].concat(),
        };
        send(sock, &answer)?;
    }
}

enum Forked {
    /// In the worker.
    Worker,
    /// In the zygote: the worker's pid.
    Started(u32),
    /// In the zygote: no worker (an errno).
    Failed(i32),
}

/// Fork a go-between that forks the worker and exits at once, so the worker is orphaned and
/// adopted by the nearest subreaper, the pool's process. The go-between first moves itself
/// into the worker's cgroup through `procs`, if given, so the worker is made there; and says
/// the worker's pid (or the negated errno) through a pipe.
fn fork_worker(procs: Option<&OwnedFd>) -> std::io::Result<Forked> {
    let (mut said, say) = std::io::pipe()?;
    // SAFETY: the zygote is single-threaded, so the go-between may run any code.
    match unsafe { libc::fork() } {
        -1 => Ok(Forked::Failed(errno())),
        0 => {
            drop(said);
            if let Some(procs) = procs {
                // Where this fails the pool moves the worker in after, as an exec'd one.
                // SAFETY: writes our own two bytes to a descriptor we hold.
                unsafe { libc::write(procs.as_raw_fd(), b"0\n".as_ptr().cast(), 2) };
            }
            // SAFETY: as above; the go-between is single-threaded too.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                drop(say);
                return Ok(Forked::Worker);
            }
            let word: i64 = if pid < 0 {
                -i64::from(errno())
            } else {
                pid.into()
            };
            let bytes = word.to_le_bytes();
            // SAFETY: writes our own buffer to our pipe, then ends this process without
            // running anything of the zygote's (no destructors, no atexit).
            unsafe {
                libc::write(say.as_raw_fd(), bytes.as_ptr().cast(), bytes.len());
                libc::_exit(0)
            }
        }
        between => {
            drop(say);
            let mut bytes = [0u8; 8];
            let read = said.read_exact(&mut bytes);
            let mut status = 0;
            // SAFETY: reaps our own child into a local.
            while unsafe { libc::waitpid(between, &mut status, 0) } < 0 && errno() == libc::EINTR {}
            if read.is_err() {
                return Ok(Forked::Failed(libc::ECHILD));
            }
            let word = i64::from_le_bytes(bytes);
            Ok(match u32::try_from(word) {
                Ok(pid) if pid > 0 => Forked::Started(pid),
                _ => Forked::Failed(i32::try_from(-word).unwrap_or(libc::EIO)),
            })
        }
    }
}

/// In a forked worker: its stdin and stdout in place of the zygote's socket, and its stderr
/// null until its job (as an exec'd worker's; the zygote's is the executor's).
fn become_worker(stdin: OwnedFd, stdout: OwnedFd) -> std::io::Result<()> {
    let null = OwnedFd::from(std::fs::File::options().write(true).open("/dev/null")?);
    for (fd, to) in [(&stdin, 0), (&stdout, 1), (&null, 2)] {
        // SAFETY: dup2 onto our own standard descriptors.
        if unsafe { libc::dup2(fd.as_raw_fd(), to) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn send(sock: BorrowedFd<'_>, body: &[u8]) -> std::io::Result<()> {
    // SAFETY: sends our own buffer on a valid socket.
    let n = unsafe {
        libc::send(
            sock.as_raw_fd(),
            body.as_ptr().cast(),
            body.len(),
            libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Why a fork through the zygote gave no worker.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ForkError {
    /// The zygote answered that the fork failed (out of processes or memory); it still serves.
    #[error("the zygote could not fork: {0}")]
    Refused(std::io::Error),
    /// The zygote is gone, stuck or confused; no use any more.
    #[error("{0}")]
    Lost(std::io::Error),
}

/// The pool's side: a started zygote.
pub(crate) struct Zygote {
    process: std::process::Child,
    sock: OwnedFd,
    forks: u32,
}

impl Zygote {
    /// Start `<exe> __vmm-worker --zygote` and wait until it serves. It is started while this
    /// process is a subreaper, so that the kernel looks for one when its go-betweens exit (a
    /// process knows whether an ancestor was one when it forked).
    pub(crate) fn start(exe: &Path) -> std::io::Result<Zygote> {
        let (ours, theirs) = crate::worker::socket_pair(libc::SOCK_SEQPACKET)?;
        let process = {
            let _subreaper = Subreaper::for_now()?;
            Command::new(exe)
                .arg(crate::worker::WORKER_SUBCOMMAND)
                .arg(ZYGOTE_ARG)
                // Its stdout is the socket too, so an older program that runs as a plain
                // worker says so at once.
                .stdout(Stdio::from(theirs.try_clone()?))
                .stdin(Stdio::from(theirs))
                .stderr(Stdio::inherit())
                .spawn()?
        };
        let mut z = Zygote {
            process,
            sock: ours,
            forks: 0,
        };
        let mut b = [0u8; 1];
        match crate::ready::read_with_timeout(&z.sock, &mut b, HELLO_TIMEOUT) {
            Ok(1) if b[0] == HELLO => Ok(z),
            Ok(0) => Err(std::io::Error::other(format!(
                "it exited before serving ({})",
                z.exit_status()
            ))),
            Ok(_) => Err(std::io::Error::other(
                "the program does not serve as a zygote (a worker program from an older build?)",
            )),
            Err(e) => Err(std::io::Error::new(
                e.kind(),
                format!("waiting {HELLO_TIMEOUT:?} for it to serve: {e}"),
            )),
        }
    }

    /// Workers forked so far.
    pub(crate) fn forks(&self) -> u32 {
        self.forks
    }

    /// How its process ended, if it has, for errors.
    fn exit_status(&mut self) -> String {
        match self.process.try_wait() {
            Ok(Some(s)) => s.to_string(),
            Ok(None) => "still running".into(),
            Err(e) => format!("its status unknown: {e}"),
        }
    }

    /// Fork a worker with `ends`: a child of this process from then on.
    pub(crate) fn fork(
        &mut self,
        ends: crate::worker::WorkerEnds<'_>,
    ) -> Result<VmmProcess, ForkError> {
        let lost = |what: String| ForkError::Lost(std::io::Error::other(what));
        let mut fds = vec![ends.stdin, ends.stdout];
        fds.extend(ends.cgroup_procs);
        // A subreaper only until the answer (the go-between has exited and the worker is
        // adopted by then), so the window in which another descendant orphaned would be
        // adopted too, and left unreaped, is that short.
        let subreaper = Subreaper::for_now().map_err(ForkError::Lost)?;
        send_with_fds(self.sock.as_fd(), &fds, &[FORK]).map_err(|e| {
            lost(format!(
                "asking the zygote to fork: {e} (the zygote: {})",
                self.exit_status()
            ))
        })?;
        let answer = recv_with_fds(self.sock.as_fd(), ANSWER_TIMEOUT, 5);
        drop(subreaper);
        let (fds, body) = match answer {
            Ok(Some(m)) => m,
            Ok(None) => return Err(lost(format!("the zygote exited ({})", self.exit_status()))),
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(lost(format!(
                    "no answer from the zygote within {ANSWER_TIMEOUT:?}"
                )))
            }
            Err(e) => return Err(lost(format!("reading the zygote's answer: {e}"))),
        };
        let word = |b: &[u8]| <[u8; 4]>::try_from(b).ok();
        let pid = match (fds.is_empty(), body.first(), body.get(1..).and_then(word)) {
            (true, Some(&FORKED), Some(w)) => u32::from_le_bytes(w),
            (true, Some(&FAILED), Some(w)) => {
                return Err(ForkError::Refused(std::io::Error::from_raw_os_error(
                    i32::from_le_bytes(w),
                )))
            }
            _ => return Err(lost(format!("unexpected answer from the zygote: {body:?}"))),
        };
        self.forks += 1;
        // The go-between was reaped before the answer, so the worker has been adopted by now:
        // it is ours only if its parent is this process. One that is not was left with no
        // stdin writer by our error: it exits on its own.
        // SAFETY: getpid has no memory effects.
        let me = unsafe { libc::getpid() } as u32;
        match crate::process::parent_of(pid) {
            Some(p) if p == me => Ok(VmmProcess::adopted(pid)),
            other => Err(lost(format!(
                "the forked worker {pid} was adopted by {other:?}, not by this process"
            ))),
        }
    }
}

impl Drop for Zygote {
    fn drop(&mut self) {
        // Its workers are ours, not its: they go on.
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

/// This process as a child subreaper until dropped, then back to what it was. Process-wide:
/// the exchanges of several pools in one process (tests, a CLI and a daemon's host) overlap,
/// and the setting goes back only when the last one ends.
struct Subreaper;

/// Exchanges in flight, and whether this process was a subreaper before the first of them.
static SUBREAPERS: std::sync::Mutex<(usize, bool)> = std::sync::Mutex::new((0, false));

impl Subreaper {
    fn for_now() -> std::io::Result<Subreaper> {
        let mut held = SUBREAPERS.lock().unwrap_or_else(|p| p.into_inner());
        if held.0 == 0 {
            let mut was: libc::c_int = 0;
            // SAFETY: prctl writes the current setting into our local.
            if unsafe { libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut was as *mut libc::c_int) }
                != 0
            {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: prctl with integer arguments.
            if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            held.1 = was != 0;
        }
        held.0 += 1;
        Ok(Subreaper)
    }
}

impl Drop for Subreaper {
    fn drop(&mut self) {
        let mut held = SUBREAPERS.lock().unwrap_or_else(|p| p.into_inner());
        held.0 -= 1;
        if held.0 == 0 && !held.1 {
            // SAFETY: prctl with integer arguments.
            unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_start_mode_parses_and_prints_back() {
        for m in [WorkerStart::Fork, WorkerStart::Exec] {
            assert_eq!(m.to_string().parse::<WorkerStart>(), Ok(m));
        }
        assert_eq!(WorkerStart::default(), WorkerStart::Fork);
        let e = "spawn".parse::<WorkerStart>().unwrap_err();
        assert!(e.contains("fork or exec"), "{e}");
    }
}
