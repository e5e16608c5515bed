//! A running child's control socket, `control.sock` in its directory: the worker serves it
//! for the life of its VM and the host connects to branch the VM. One JSON request line and
//! one JSON reply line per connection. Only the host's user reaches it (mode 0600, in the
//! host's own VM directory); it survives a daemon restart, so adopted VMs can be branched.
//! A live branch sends one interim line, `resumed`, when the guest runs again.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tine_vmm::kvm_stats::Counters;
use tine_vmm::vm::{DeviceLoop, RunningVm, SnapshotKind};

pub const CONTROL_SOCKET: &str = "control.sock";
/// Longest request line a worker reads: a request is a path and a word.
const MAX_REQUEST: usize = 8 << 10;

/// What a branch holds of the VM's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BranchKind {
    /// A complete memory image: stands alone.
    Full,
    /// Only the pages written since the VM was forked, over the snapshot it was forked from.
    Diff,
    /// A diff written after the VM resumes: paused only to save its state and fork its VMM
    /// (whose copy-on-write memory keeps the instant while the guest runs on).
    Live,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Pause, write a snapshot into `dir` (which must not exist), resume.
    Branch { dir: PathBuf, kind: BranchKind },
    /// Pause and resume at once: the floor under a branch's pause window.
    PauseResume,
    /// A booted parent, warmed: pause for good and write its complete snapshot into `dir`
    /// (made and lent by the host). The VM stays paused; the host then ends the VMM.
    Snapshot { dir: PathBuf },
    /// Take the diff branch in `dir` (complete, in place) as what the VM is a diff over from
    /// now on, so its next branch holds only what changed since.
    Rebase { dir: PathBuf },
    /// KVM's counters for the VM so far (see [`tine_vmm::kvm_stats`]).
    KvmCounters,
}

impl Request {
    /// The request with the host's paths as this VMM sees them (see [`crate::confine::view`]).
    fn in_view(self) -> Result<Request, crate::confine::ConfineError> {
        use crate::confine::view::translate;
        Ok(match self {
            Request::Branch { dir, kind } => Request::Branch {
                dir: translate(&dir)?,
                kind,
            },
            Request::Rebase { dir } => Request::Rebase {
                dir: translate(&dir)?,
            },
            Request::Snapshot { dir } => Request::Snapshot {
                dir: translate(&dir)?,
            },
            r @ (Request::PauseResume | Request::KvmCounters) => r,
        })
    }
}

#[derive(Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    /// Interim (live branches only): the guest runs again; the pages are still being written.
    Resumed {
        paused_us: u64,
        /// The diff's parent (None: a complete image).
        parent: Option<String>,
    },
    Rebased {
        paused_us: u64,
        pages_mapped: u64,
        pages_kept: u64,
    },
    Branched {
        /// How long the guest was paused, in microseconds.
        paused_us: u64,
        /// Pages the VM wrote since it was forked.
        pages_written: u64,
    },
    Paused {
        paused_us: u64,
    },
    Snapshotted {
        /// Pause and write, in microseconds.
        took_us: u64,
    },
    /// None: the host's KVM keeps no statistics files (before Linux 5.14).
    KvmCounters {
        counters: Option<Counters>,
    },
    Failed {
        reason: String,
    },
}

/// Bind the control socket in `vm_dir` (before the host learns the VM runs). Non-blocking:
/// [`serve_until_stopped`] accepts only when `poll` says a connection waits, and a connection
/// that went away meanwhile must not leave it blocked.
pub fn bind(vm_dir: &Path) -> std::io::Result<UnixListener> {
    let path = vm_dir.join(CONTROL_SOCKET);
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

/// The VMM's main thread for the life of its VM: it turns the event loops of `vm`'s devices
/// that run here (see [`tine_vmm::vm::DeviceLoop`]), and takes connections on the control
/// socket, until one of `vm`'s vCPUs stops; then [`RunningVm::wait_exit`] has the guest's end.
/// A thread per device loop and one for a socket that is rarely called would cost each child a
/// kernel stack, a task and stack pages apiece. Each connection is answered on a thread of its
/// own, one at a time, so that a branch (which writes a snapshot, and for a live one waits for
/// its copier while the guest runs on) never holds up the devices.
///
/// At `give_back_at` it gives back the guest RAM pages the VMM holds unchanged from the
/// snapshot ([`RunningVm::give_back_unchanged`]), once, between two requests.
pub fn serve_until_stopped(
    listener: &UnixListener,
    vm: &'static RunningVm,
    mut loops: Vec<Box<dyn DeviceLoop>>,
    mut give_back_at: Option<Instant>,
) {
    use std::os::fd::AsRawFd;
    // Each loop waits first, as a device thread does: a turn before any event had its watchdog
    // act on the interrupts of the restore, and made the Wake slower (docs/performance.md).
    let mut due: Vec<Option<Instant>> = loops
        .iter()
        .map(|l| Some(Instant::now() + l.first_wait()))
        .collect();
    // False once the socket can take no more connections: poll skips a negative descriptor.
    let mut listening = true;
    loop {
        let mut fds = vec![
            pollfd(vm.stopped_fd().as_raw_fd()),
            pollfd(if listening { listener.as_raw_fd() } else { -1 }),
        ];
        // fds[2..] are the live loops', in this order.
        let live: Vec<usize> = (0..loops.len()).filter(|&i| due[i].is_some()).collect();
        fds.extend(live.iter().map(|&i| pollfd(loops[i].fd().as_raw_fd())));
        let now = Instant::now();
        let timeout = due
            .iter()
            .flatten()
            .chain(&give_back_at)
            .min()
            .map_or(-1, |at| ceil_ms(at.saturating_duration_since(now)));
        // SAFETY: valid pollfds, for descriptors that outlive the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            // Cannot happen with valid descriptors; the VM's end must still be waited for.
            tracing::warn!("VMM main loop: poll failed ({e}); devices and control stop here");
            return;
        }
        if fds[0].revents != 0 {
            return;
        }
        if fds[1].revents != 0 {
            // No more requests after a refusal; the devices still need turning.
            listening = accept(listener, vm);
        }
        let now = Instant::now();
        for (k, &i) in live.iter().enumerate() {
            let woken = fds[2 + k].revents != 0;
            if woken || due[i].is_some_and(|at| at <= now) {
                due[i] = next_turn(loops[i].turn());
            }
        }
        if give_back_at.is_some_and(|at| at <= now) {
            give_back_at = give_back(vm);
        }
    }
}

/// Give back the pages `vm` holds unchanged, unless a request is being answered (a branch
/// pauses the guest itself, and the devices turned here must not wait for it): None once
/// done, or when to try again.
fn give_back(vm: &RunningVm) -> Option<Instant> {
    let _one = match ONE_AT_A_TIME.try_lock() {
        Ok(one) => one,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => {
            return Some(Instant::now() + Duration::from_secs(1))
        }
    };
    let t0 = Instant::now();
    let line = match vm.give_back_unchanged() {
        Ok(Some(g)) if g.skipped() => format!(
            "tine-vmm: no guest RAM pages given back: {} private pages, more than a pass compares\n",
            g.private_pages
        ),
        Ok(Some(g)) => format!(
            "tine-vmm: gave back {} of {} private guest RAM pages, unchanged from the snapshot ({} equal while the guest ran), in {:.1} ms; guest pauses {}, the longest {:.1} ms\n",
            g.given_back,
            g.private_pages,
            g.candidates,
            t0.elapsed().as_secs_f64() * 1e3,
            g.pauses,
            g.paused.as_secs_f64() * 1e3
        ),
        // Not RAM over a sole snapshot image, or the guest is stopping: nothing to say.
        Ok(None) => return None,
        Err(e) if e.is_stopping() => return None,
        Err(e) => format!("tine-vmm: guest RAM pages not given back: {e}\n"),
    };
    let _ = std::io::stderr().write_all(line.as_bytes());
    None
}

/// Requests are answered one at a time, as a single thread served them, and the give-back
/// runs between two of them.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn pollfd(fd: std::os::fd::RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

fn next_turn(wait: Option<Duration>) -> Option<Instant> {
    wait.map(|d| Instant::now() + d)
}

/// `d` in whole milliseconds for poll, rounded up (rounded down, a wait shorter than 1 ms
/// would spin).
fn ceil_ms(d: Duration) -> i32 {
    d.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
}

/// Take a waiting connection and answer it on a thread of its own (see
/// [`serve_until_stopped`]). False when the socket can take no more.
fn accept(listener: &UnixListener, vm: &'static RunningVm) -> bool {
    let conn = match listener.accept() {
        Ok((conn, _)) => conn,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock
                    | std::io::ErrorKind::Interrupted
                    | std::io::ErrorKind::ConnectionAborted
            ) =>
        {
            return true
        }
        Err(e) => {
            tracing::warn!("control socket: accept failed ({e}); no more requests served");
            return false;
        }
    };
    // The connection moves into the thread only once it exists: a refusal (a child at its
    // cgroup's pids.max) leaves it here, to be answered on this thread instead.
    let (tx, rx) = std::sync::mpsc::channel::<UnixStream>();
    let spawned = tine_vmm::thread_builder("control").spawn(move || {
        if let Ok(conn) = rx.recv() {
            answer_one(conn, vm)
        }
    });
    match spawned {
        Ok(_) => {
            let _ = tx.send(conn);
        }
        Err(e) => {
            tracing::warn!("control connection answered on the main thread: no thread ({e})");
            answer_one(conn, vm);
        }
    }
    true
}

/// [`answer`], one request at a time, as a single thread served them.
fn answer_one(conn: UnixStream, vm: &RunningVm) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    if let Err(e) = answer(conn, vm) {
        tracing::warn!("control connection: {e}");
    }
}

fn answer(conn: UnixStream, vm: &RunningVm) -> std::io::Result<()> {
    conn.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut line = String::new();
    BufReader::new((&conn).take(MAX_REQUEST as u64)).read_line(&mut line)?;
    let request = serde_json::from_str::<Request>(&line)
        .map_err(|e| format!("bad control request: {e}"))
        .and_then(|r| r.in_view().map_err(|e| e.to_string()));
    let reply = match request {
        Err(reason) => Reply::Failed { reason },
        Ok(Request::Branch { dir, kind }) => {
            let branched = match kind {
                BranchKind::Full => vm.branch(&dir, SnapshotKind::Full),
                BranchKind::Diff => vm.branch(&dir, SnapshotKind::Diff),
                BranchKind::Live => {
                    vm.branch_live_then(&dir, SnapshotKind::Diff, |paused, parent| {
                        let resumed = Reply::Resumed {
                            paused_us: paused.as_micros() as u64,
                            parent: parent.map(str::to_owned),
                        };
                        // A host that went away misses only the interim news.
                        let _ = send(&conn, &resumed);
                    })
                }
            };
            match branched {
                Ok(b) => Reply::Branched {
                    paused_us: b.paused.as_micros() as u64,
                    pages_written: b.pages_written,
                },
                Err(e) => Reply::Failed {
                    reason: e.to_string(),
                },
            }
        }
        Ok(Request::Rebase { dir }) => match vm.rebase(&dir) {
            Ok(r) => Reply::Rebased {
                paused_us: r.paused.as_micros() as u64,
                pages_mapped: r.counts.pages_mapped,
                pages_kept: r.counts.pages_kept,
            },
            Err(e) => Reply::Failed {
                reason: e.to_string(),
            },
        },
        Ok(Request::Snapshot { dir }) => {
            let t0 = std::time::Instant::now();
            match vm.snapshot(&dir) {
                Ok(_) => Reply::Snapshotted {
                    took_us: t0.elapsed().as_micros() as u64,
                },
                Err(e) => Reply::Failed {
                    reason: e.to_string(),
                },
            }
        }
        Ok(Request::KvmCounters) => Reply::KvmCounters {
            counters: vm.kvm_counters(),
        },
        Ok(Request::PauseResume) => {
            let t0 = std::time::Instant::now();
            let paused = vm.pause();
            vm.resume();
            match paused {
                Ok(()) => Reply::Paused {
                    paused_us: t0.elapsed().as_micros() as u64,
                },
                Err(e) => Reply::Failed {
                    reason: e.to_string(),
                },
            }
        }
    };
    send(&conn, &reply)
}

fn send(conn: &UnixStream, reply: &Reply) -> std::io::Result<()> {
    let mut out = serde_json::to_vec(reply).expect("reply serializes");
    out.push(b'\n');
    (&*conn).write_all(&out)
}

/// Send `req` to the VM whose directory is `vm_dir` and wait up to `timeout` for its reply.
pub fn request(vm_dir: &Path, req: &Request, timeout: Duration) -> std::io::Result<Reply> {
    request_then(vm_dir, req, timeout, |_| {})
}

/// [`request`], handing interim replies ([`Reply::Resumed`]) to `interim` as they come.
pub fn request_then(
    vm_dir: &Path,
    req: &Request,
    timeout: Duration,
    mut interim: impl FnMut(&Reply),
) -> std::io::Result<Reply> {
    let conn = UnixStream::connect(vm_dir.join(CONTROL_SOCKET))?;
    conn.set_read_timeout(Some(timeout))?;
    conn.set_write_timeout(Some(Duration::from_secs(10)))?;
    let mut line = serde_json::to_vec(req).expect("request serializes");
    line.push(b'\n');
    (&conn).write_all(&line)?;
    let mut lines = BufReader::new(&conn);
    loop {
        let mut line = String::new();
        lines.read_line(&mut line)?;
        if line.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the VM closed its control socket without answering (did it exit?)",
            ));
        }
        match serde_json::from_str(&line).map_err(std::io::Error::other)? {
            r @ Reply::Resumed { .. } => interim(&r),
            r => return Ok(r),
        }
    }
}
