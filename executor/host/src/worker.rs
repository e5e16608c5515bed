//! Pre-started VMM worker processes. The daemon is multi-threaded, so it must not fork(2)
//! VMMs itself; instead it keeps a few worker processes (`tine-vmm-worker __vmm-worker`, or
//! `tine __vmm-worker`: the executable is `HostConfig::worker_exe`) started and waiting,
//! and hands one a snapshot when a child is asked for: process creation, exec and dynamic
//! loading are off the spawn critical path. Each child is still its own process.
//!
//! Protocol: the host writes one JSON line (`WorkerJob`) to the worker's stdin; the worker
//! restores the snapshot (or boots a parent from its kernel) and, once the guest runs and
//! its vsock socket exists, writes a [`Restored`] record (how long the KVM restore and the
//! vCPU start took) to stdout, then runs the VM until it stops and exits with the VM's exit
//! code. The worker's stdout is a
//! Unix socket, so a lazily restored child can first send the userfaultfd of its guest RAM
//! (see [`crate::handoff`]).

use std::io::{BufRead, Write};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::process::VmmProcess;
use crate::zygote::{WorkerStart, Zygote};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use tine_vmm::vm::RestoreOptions;
use tine_vmm::Vm;

use crate::cgroup::{Cgroups, IdleCgroup};
use crate::console::open_console;
use crate::error::{HostError, Result};
use crate::pool_size::{PoolBounds, PoolSize};
use crate::process::ProcessIdentity;

/// The hidden subcommand that runs `worker_main`.
pub const WORKER_SUBCOMMAND: &str = "__vmm-worker";

/// The job an executor hands a worker. A field the worker does not know fails the job
/// (`deny_unknown_fields` here and in what it holds): a worker from another build must never
/// drop something it was asked to do, such as a confinement setting.
#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerJob {
    pub vm: JobVm,
    /// The VM's directory: console.log, vmm.log, vsock.sock, control.sock.
    pub dir: PathBuf,
    /// The network namespace to run in, whose tap backs the guest's interface (None: the
    /// interface, if the snapshot has one, has no link; a booted parent gets none).
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// Its user and system-call filter.
    #[serde(default)]
    pub confine: crate::confine::WorkerConfinement,
    /// A child's guest RAM is open to the host's page merging (KSM; see
    /// [`crate::Limits::merge_pages`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub merge_pages: bool,
    /// Milliseconds after the guest starts to give back the guest RAM pages the child holds
    /// unchanged from its snapshot (see [`crate::Limits::give_back_after`]); None: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub give_back_after_ms: Option<u64>,
    /// Tests only: once confined, make a system call outside the allow-list.
    #[cfg(feature = "testing")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub trip_seccomp: bool,
}

/// The VM a worker runs.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum JobVm {
    /// A child: restore the snapshot in `snapshot`.
    Restore {
        snapshot: PathBuf,
        #[serde(default)]
        memory: JobMemory,
    },
    /// A parent: boot a kernel, to be warmed and snapshotted by the host (its control socket
    /// takes a [`crate::control::Request::Snapshot`] into a directory under `snapshots`).
    Boot(BootJob),
    /// No VM: confine itself as for one (its view over `snapshots`, /dev/kvm opened inside
    /// it, the lock-down), report, and exit. A host checks at start that confinement works.
    Probe { snapshots: PathBuf },
}

/// A parent to boot. Paths are the host's, absolute.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootJob {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub vcpus: u8,
    pub mem_mib: u64,
    /// The directory its snapshot will be written under (what a confined VMM sees of the
    /// host's snapshots).
    pub snapshots: PathBuf,
}

impl JobVm {
    /// The directory a confined VMM sees as its snapshots, and the files outside it that it
    /// must read (a fetched image's memory, a parent's kernel and initrd). `linked`: a
    /// restore's, found already (by the priming for its snapshot); else looked up now.
    fn view(&self, linked: Option<Vec<PathBuf>>) -> Option<(&Path, Vec<PathBuf>)> {
        match self {
            JobVm::Restore { snapshot, .. } => {
                let snapshots = snapshot.parent()?;
                Some((
                    snapshots,
                    linked
                        .unwrap_or_else(|| crate::confine::view::linked_files(snapshot, snapshots)),
                ))
            }
            JobVm::Probe { snapshots } => Some((snapshots, Vec::new())),
            JobVm::Boot(b) => Some((
                &b.snapshots,
                std::iter::once(&b.kernel)
                    .chain(&b.initrd)
                    .cloned()
                    .collect(),
            )),
        }
    }
}

/// A line from the host to a waiting worker.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Order {
    /// Make ready for children of a snapshot, answered with one byte ([`PRIMED`] or
    /// [`NOT_PRIMED`]); a held image follows the line on the report socket.
    Prime(PrimeJob),
    /// The job; the last line a worker reads.
    Run(WorkerJob),
}

/// The snapshot a waiting worker primes itself for: its restore done up to what needs the
/// child (see [`tine_vmm::vm::Primed`]) and its working set mapped. It then serves a job for
/// that snapshot (any memory but lazy) from there, unless the snapshot's files changed since.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrimeJob {
    pub snapshot: PathBuf,
    /// Image or held (a lazy restore is never primed: its pages come with the child).
    pub memory: JobMemory,
}

/// A worker's answers to [`Order::Prime`].
pub const PRIMED: u8 = b'P';
pub const NOT_PRIMED: u8 = b'F';

/// Where a child's guest RAM comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobMemory {
    /// The snapshot's memory image, mapped copy-on-write.
    #[default]
    Image,
    /// Anonymous RAM whose pages the host supplies on first touch (userfaultfd): the
    /// snapshot directory holds only the header and state.
    Lazy,
    /// A copy of the snapshot's memory image that the host holds in huge pages (see
    /// [`crate::hot`]), sent over the report socket right after the job; mapped
    /// copy-on-write as the image would be.
    Held,
}

/// How long a worker waits for the image the host holds, once told one comes.
const IMAGE_TIMEOUT: Duration = Duration::from_secs(30);

/// What a worker reports once its guest runs: `R`, then the restore and start times in
/// microseconds (little-endian u64 each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restored {
    /// `Vm::restore`: KVM VM, memory mapping, vCPU and device state.
    pub restore: Duration,
    /// `start`: vCPU threads created and running the guest.
    pub start: Duration,
}

impl Restored {
    pub const LEN: usize = 17;

    pub fn encode(&self) -> [u8; Self::LEN] {
        let mut b = [0u8; Self::LEN];
        b[0] = b'R';
        b[1..9].copy_from_slice(&(self.restore.as_micros() as u64).to_le_bytes());
        b[9..17].copy_from_slice(&(self.start.as_micros() as u64).to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::LEN]) -> Option<Restored> {
        if b[0] != b'R' {
            return None;
        }
        let us = |r: &[u8]| Duration::from_micros(u64::from_le_bytes(r.try_into().unwrap()));
        Some(Restored {
            restore: us(&b[1..9]),
            start: us(&b[9..17]),
        })
    }
}

/// What a worker sends first, once it has started and waits for its job.
const IDLE: u8 = b'I';
/// How long a started worker may take to say it waits (a loaded host starts processes slowly).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A started worker waiting for its job.
pub struct Worker {
    /// Taken when the job is handed over; a worker dropped before that is killed and reaped.
    child: Option<VmmProcess>,
    stdin: Option<std::io::PipeWriter>,
    stdout: Option<OwnedFd>,
    /// It said it waits for its job ([`IDLE`] was read).
    waiting: bool,
    /// The snapshot it primed itself for (it answered [`PRIMED`]).
    primed: Option<PathBuf>,
    /// Read as it started, so a spawn that takes it need not.
    identity: Option<ProcessIdentity>,
    /// The cgroup it waits in (see [`IdleCgroup`]); removed as it is dropped, after `drop`
    /// has killed and reaped the worker.
    cgroup: Option<IdleCgroup>,
}

impl Worker {
    /// Start a worker: forked by `fork` if that gives one (see [`WorkerPool::fork`]), else from
    /// `exe`; in a cgroup of its own made from `cgroups` if there are any (without one, said
    /// in the log, it is moved into its child's at its spawn).
    fn start(
        exe: &Path,
        cgroups: Option<&Cgroups>,
        fork: impl FnOnce(WorkerEnds<'_>) -> Option<VmmProcess>,
    ) -> Result<Worker> {
        use std::os::fd::AsFd;
        let failed = |source| HostError::Worker {
            exe: exe.to_path_buf(),
            source,
        };
        let (ours, theirs) = socket_pair(libc::SOCK_STREAM).map_err(failed)?;
        let (stdin_r, stdin) = std::io::pipe().map_err(failed)?;
        let cgroup = cgroups.and_then(|c| {
            c.make_idle()
                .map_err(|e| tracing::warn!("VMM worker pool: a cgroup for a worker: {e}"))
                .ok()
        });
        // A forked worker is made inside its cgroup where it can be, so what its fork makes
        // (its memory map, its page tables) is charged there, not to the executor.
        let procs = cgroup.as_ref().and_then(|cg| cg.procs_file().ok());
        let ends = WorkerEnds {
            stdin: stdin_r.as_fd(),
            stdout: theirs.as_fd(),
            cgroup_procs: procs.as_ref().map(|f| f.as_fd()),
        };
        let child = match fork(ends) {
            Some(child) => child,
            // No code between fork and exec, so the standard library starts it with posix_spawn
            // (a vfork): the executor's page tables are not copied for each worker (a cost that
            // grows with the executor's memory, and the copy-on-write faults after it).
            None => VmmProcess::started(
                Command::new(exe)
                    .arg(WORKER_SUBCOMMAND)
                    .stdin(Stdio::from(stdin_r))
                    .stdout(Stdio::from(theirs))
                    .stderr(Stdio::null())
                    .spawn()
                    .map_err(failed)?,
            ),
        };
        // Moved into its cgroup as it starts (a forked one is there already: this does nothing
        // then): what it maps from then on is charged there; the few pages an exec'd worker's
        // loader touched before stay charged to the executor until it exits.
        let cgroup = cgroup.and_then(|cg| match cg.enter(child.id()) {
            Ok(()) => Some(cg),
            // A host that lets us make a cgroup but not move into it: it is moved into its
            // child's at the spawn.
            Err(e) => {
                tracing::warn!("VMM worker pool: moving a worker into its own cgroup: {e}");
                None
            }
        });
        let identity = ProcessIdentity::of(child.id()).ok();
        Ok(Worker {
            child: Some(child),
            stdin: Some(stdin),
            stdout: Some(ours),
            waiting: false,
            primed: None,
            identity,
            cgroup,
        })
    }

    /// Its identity, read as it started if that could be.
    pub fn identity(&self) -> std::io::Result<ProcessIdentity> {
        match &self.identity {
            Some(i) => Ok(i.clone()),
            None => ProcessIdentity::of(self.pid()),
        }
    }

    /// The cgroup it waits in, if it has one (see [`Worker::run`]).
    pub fn cgroup(&self) -> Option<&IdleCgroup> {
        self.cgroup.as_ref()
    }

    /// Block until the worker has started and waits for its job (its first byte). A pool that
    /// hands out only such workers keeps their start-up (exec, loading, setting up) out of a
    /// spawn's time and off the CPU while children are restored.
    fn wait_started(&mut self) -> Result<()> {
        if self.waiting {
            return Ok(());
        }
        let fd = self.stdout.as_ref().expect("before its job");
        let mut b = [0u8; 1];
        let read = crate::ready::read_with_timeout(fd, &mut b, START_TIMEOUT);
        match read {
            Ok(1) if b[0] == IDLE => {
                self.waiting = true;
                Ok(())
            }
            Ok(_) => Err(HostError::io("starting a VMM worker")(
                std::io::Error::other(
                    "it exited or said something else before waiting for its job",
                ),
            )),
            Err(e) => Err(HostError::io("starting a VMM worker")(e)),
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, VmmProcess::id)
    }

    /// Whether it is primed for the snapshot in `dir`: a job for it needs no held image sent.
    pub fn primed_for(&self, dir: &Path) -> bool {
        self.primed.as_deref() == Some(dir)
    }

    /// Send a waiting worker [`Order::Prime`] (and `image`, for a held one); see
    /// [`Worker::primed_answer`].
    fn send_prime(&mut self, hot: &Hot) -> std::io::Result<()> {
        use std::os::fd::AsFd;
        self.primed = None;
        let mut line =
            serde_json::to_vec(&Order::Prime(hot.job.clone())).expect("order serializes");
        line.push(b'\n');
        self.stdin
            .as_mut()
            .expect("before its job")
            .write_all(&line)?;
        if let (JobMemory::Held, Some(image)) = (hot.job.memory, &hot.image) {
            let sock = self.stdout.as_ref().expect("before its job");
            crate::handoff::send_image(sock.as_fd(), image.as_fd())?;
        }
        Ok(())
    }

    /// Wait for its answer to [`Worker::send_prime`]: primed or not (it stays a plain
    /// worker). An error (it exited, said something else, or took too long) means it is
    /// no use any more.
    fn primed_answer(&mut self, hot: &Hot) -> std::io::Result<bool> {
        let fd = self.stdout.as_ref().expect("before its job");
        let mut b = [0u8; 1];
        match crate::ready::read_with_timeout(fd, &mut b, START_TIMEOUT)? {
            1 if b[0] == PRIMED => {
                self.primed = Some(hot.job.snapshot.clone());
                Ok(true)
            }
            1 if b[0] == NOT_PRIMED => Ok(false),
            _ => Err(std::io::Error::other(
                "it exited or said something else than whether it primed itself",
            )),
        }
    }

    /// Hand over the job. Returns the process (to reap), the "restored" signal pipe and the
    /// cgroup it waited in, which the caller keeps ([`IdleCgroup::keep`]) or drops once the
    /// process is reaped.
    pub fn run(
        mut self,
        job: &WorkerJob,
    ) -> Result<(VmmProcess, std::fs::File, Option<IdleCgroup>)> {
        // `Order::Run(job)`, written around the borrowed job.
        let mut line = b"{\"run\":".to_vec();
        serde_json::to_writer(&mut line, job).expect("job serializes");
        line.extend_from_slice(b"}\n");
        let mut stdin = self.stdin.take().expect("a worker runs one job");
        // On failure `self` is dropped, which kills and reaps the worker.
        stdin
            .write_all(&line)
            .map_err(HostError::io("handing the job to a VMM worker"))?;
        drop(stdin);
        // A worker started just now (the pool was empty) reads the job once it is up; its
        // first byte must not be taken for its report.
        self.wait_started()?;
        let child = self.child.take().expect("a worker runs one job");
        let stdout = self.stdout.take().expect("a worker runs one job");
        Ok((child, std::fs::File::from(stdout), self.cgroup.take()))
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A connected pair of Unix sockets of `kind` (close-on-exec); for a worker, stream sockets,
/// and the child's end becomes its stdout.
pub(crate) fn socket_pair(kind: libc::c_int) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use std::os::fd::FromRawFd;
    let mut fds = [0; 2];
    // SAFETY: socketpair fills two descriptors that we then own.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            kind | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fresh descriptors from socketpair.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The snapshot a pool primes its idle workers for (the one its host spawns from), and the
/// held copy of its image if the workers are to map that.
#[derive(Clone, Debug)]
pub struct Hot {
    pub job: PrimeJob,
    pub image: Option<Arc<std::fs::File>>,
}

/// How many idle workers are primed at once: the others stay ready to be taken meanwhile.
const PRIME_BATCH: usize = 4;

/// How long a refill waits for the spawns in flight to end before it starts workers anyway:
/// started meanwhile, they would take the CPU those spawns' children need.
const REFILL_WAITS_FOR_SPAWNS: Duration = Duration::from_secs(5);

/// Keeps up to its target of idle workers started, primed for the hot snapshot if there is
/// one. The target grows by what spawns found missing, up to a ceiling, and shrinks back after
/// a quiet period ([`PoolSize`]). At most one refill runs at a time; it waits for the spawns
/// in flight to end, then stops at the target, so a burst of spawns never leaves more than
/// that idle behind.
pub struct WorkerPool {
    exe: PathBuf,
    size: PoolSize,
    /// Spawns in flight (see [`WorkerPool::spawning`]), and its change.
    in_flight: Mutex<usize>,
    quiet: std::sync::Condvar,
    /// Start a replacement in the background whenever one is taken (a daemon), or only when
    /// asked (a one-shot fork that pre-starts all it needs before its clock starts).
    auto_refill: bool,
    idle: Mutex<Vec<Worker>>,
    refilling: AtomicBool,
    hot: Mutex<Option<Hot>>,
    /// Each worker is started in a cgroup of its own made here (None: no cgroups).
    cgroups: Option<Arc<Cgroups>>,
    /// The workers' program read once by this process before the first starts in a cgroup
    /// of its own, so its file pages are charged here, not to that worker's child.
    program_charged: std::sync::Once,
    /// How workers are started, and the zygote that forks them (see [`crate::zygote`]).
    start: WorkerStart,
    zygote: Mutex<ZygoteSlot>,
}

/// The pool's zygote.
enum ZygoteSlot {
    /// None yet (or the last one was ended): started by the next worker start.
    NotStarted,
    Up(Zygote),
    /// The program could not serve as one: workers are started from the program.
    Unavailable,
}

/// What a worker starts with: its stdin (a pipe's read end), its stdout (the report socket),
/// and its idle cgroup's `cgroup.procs` opened for writing, if it has one.
pub(crate) struct WorkerEnds<'a> {
    pub stdin: BorrowedFd<'a>,
    pub stdout: BorrowedFd<'a>,
    pub cgroup_procs: Option<BorrowedFd<'a>>,
}

impl WorkerPool {
    pub fn new(
        exe: PathBuf,
        bounds: PoolBounds,
        auto_refill: bool,
        cgroups: Option<Arc<Cgroups>>,
        start: WorkerStart,
    ) -> Arc<WorkerPool> {
        Arc::new(WorkerPool {
            exe,
            size: PoolSize::new(bounds),
            in_flight: Mutex::new(0),
            quiet: std::sync::Condvar::new(),
            auto_refill,
            idle: Mutex::new(Vec::new()),
            refilling: AtomicBool::new(false),
            hot: Mutex::new(None),
            cgroups,
            program_charged: std::sync::Once::new(),
            start,
            zygote: Mutex::new(ZygoteSlot::NotStarted),
        })
    }

    /// Start a worker (see [`Worker::start`]).
    fn start_worker(&self) -> Result<Worker> {
        if self.cgroups.is_some() {
            self.program_charged.call_once(|| {
                if let Err(e) = crate::cgroup::charge_program(&self.exe) {
                    tracing::warn!(exe = %self.exe.display(), "reading the VMM worker's program ahead: {e}");
                }
            });
        }
        Worker::start(&self.exe, self.cgroups.as_deref(), |ends| {
            (self.start == WorkerStart::Fork)
                .then(|| self.fork(ends))
                .flatten()
        })
    }

    /// A worker forked by the pool's zygote (started first if there is none), or None: start
    /// it from the program. The zygote's lock is held for the exchange only.
    fn fork(&self, ends: WorkerEnds<'_>) -> Option<VmmProcess> {
        let mut slot = self.zygote.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*slot, ZygoteSlot::NotStarted) {
            *slot = match Zygote::start(&self.exe) {
                Ok(z) => ZygoteSlot::Up(z),
                Err(e) => {
                    tracing::warn!(exe = %self.exe.display(), "VMM worker pool: no zygote, workers are started from the program: {e}");
                    ZygoteSlot::Unavailable
                }
            };
        }
        let ZygoteSlot::Up(z) = &mut *slot else {
            return None;
        };
        match z.fork(ends) {
            Ok(child) => {
                // A new layout for the next ones (see FORKS_PER_ZYGOTE).
                if z.forks() >= crate::zygote::FORKS_PER_ZYGOTE {
                    *slot = ZygoteSlot::NotStarted;
                }
                Some(child)
            }
            // It answered that this fork failed (out of processes or memory): it stays, and
            // this worker is started from the program.
            Err(crate::zygote::ForkError::Refused(e)) => {
                tracing::warn!(exe = %self.exe.display(), "VMM worker pool: the zygote could not fork a worker ({e}); started from the program");
                None
            }
            // It is gone or stuck: replaced at the next start.
            Err(crate::zygote::ForkError::Lost(e)) => {
                tracing::warn!(exe = %self.exe.display(), "VMM worker pool: the zygote failed ({e}); this worker is started from the program, and a new zygote at the next start");
                *slot = ZygoteSlot::NotStarted;
                None
            }
        }
    }

    /// An idle worker, or a freshly started one when the pool is empty.
    pub fn take(self: &Arc<Self>) -> Result<Worker> {
        self.take_for(None)
    }

    /// An idle worker, one primed for the snapshot in `snapshot` if there is one, else one
    /// primed for none (its shell unused), else any.
    pub fn take_for(self: &Arc<Self>, snapshot: Option<&Path>) -> Result<Worker> {
        let w = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let at = snapshot
                .and_then(|s| idle.iter().rposition(|w| w.primed_for(s)))
                .or_else(|| idle.iter().rposition(|w| w.primed.is_none()))
                .or_else(|| idle.len().checked_sub(1));
            at.map(|i| idle.remove(i))
        };
        let w = match w {
            Some(w) => w,
            None => {
                self.size.missed(Instant::now());
                self.start_worker()?
            }
        };
        if self.auto_refill
            && self.size.target() > 0
            && !self.refilling.swap(true, Ordering::AcqRel)
        {
            let pool = self.clone();
            std::thread::spawn(move || loop {
                pool.wait_for_spawns(REFILL_WAITS_FOR_SPAWNS);
                // After the wait: what the burst found missing is counted by then.
                pool.size.grow();
                pool.fill_to_target();
                pool.refilling.store(false, Ordering::Release);
                // Takes that found the pool short after the wait (a burst longer than it) saw
                // this refill running and left the growth to it.
                if pool.size.pending() == 0 || pool.refilling.swap(true, Ordering::AcqRel) {
                    break;
                }
            });
        }
        Ok(w)
    }

    /// A spawn in flight until the guard drops: a refill waits for it (at most
    /// [`REFILL_WAITS_FOR_SPAWNS`]).
    pub fn spawning(&self) -> Spawning<'_> {
        *self.in_flight.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        Spawning(self)
    }

    /// Until no spawn is in flight, or `at_most` passed.
    fn wait_for_spawns(&self, at_most: Duration) {
        let n = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self
            .quiet
            .wait_timeout_while(n, at_most, |n| *n > 0)
            .unwrap_or_else(|p| p.into_inner());
    }

    /// Idle workers the pool keeps now (its floor, or more after bursts found it short).
    pub fn target(&self) -> usize {
        self.size.target()
    }

    /// Back to its floor once no spawn found it short for its quiet period: the surplus idle
    /// workers are ended, those primed for no snapshot or another than the hot one first.
    pub fn shrink_if_quiet(&self) {
        let Some(target) = self.size.shrink(Instant::now()) else {
            return;
        };
        let hot = self
            .hot
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|h| h.job.snapshot.clone());
        let surplus: Vec<Worker> = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            // Primed for the hot snapshot last, so they are the ones kept.
            idle.sort_by_key(|w| hot.as_deref().is_some_and(|h| w.primed_for(h)));
            let n = idle.len().saturating_sub(target);
            idle.drain(..n).collect()
        };
        if !surplus.is_empty() {
            tracing::info!(
                ended = surplus.len(),
                target,
                "VMM worker pool: back to its floor after a quiet period"
            );
        }
        // Each is killed and reaped as it is dropped, outside the lock.
        drop(surplus);
    }

    /// Prime idle workers for `hot` from now on (None: no more priming). Those primed for
    /// another snapshot keep it until taken.
    pub fn set_hot(&self, hot: Option<Hot>) {
        *self.hot.lock().unwrap_or_else(|p| p.into_inner()) = hot;
    }

    /// The snapshot in `dir` went away or was replaced: no more priming for it, and its idle
    /// workers (which hold its files open) are ended.
    pub fn forget(&self, dir: &Path) {
        {
            let mut hot = self.hot.lock().unwrap_or_else(|p| p.into_inner());
            if hot.as_ref().is_some_and(|h| h.job.snapshot == dir) {
                *hot = None;
            }
        }
        // Each one removed is killed and reaped as it is dropped (outside the lock).
        let gone: Vec<Worker> = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            let (gone, kept) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|w| w.primed_for(dir));
            *idle = kept;
            gone
        };
        drop(gone);
    }

    /// Start workers until the target are idle.
    pub fn refill(&self) {
        self.fill_to_target();
    }

    /// Start workers until `n` are idle, each waiting for its job (a one-shot fork pre-starts
    /// exactly what it needs), then prime the idle ones for the hot snapshot.
    pub fn fill_to(&self, n: usize) {
        self.fill(|| n);
    }

    /// Start workers until the pool's target are idle, never past the target as it is when
    /// each is ready (it may shrink meanwhile).
    fn fill_to_target(&self) {
        self.fill(|| self.size.target());
    }

    fn fill(&self, want: impl Fn() -> usize) {
        let missing = want().saturating_sub(self.idle());
        // Start them all before waiting for any, so their start-ups overlap.
        let mut started = Vec::with_capacity(missing);
        for _ in 0..missing {
            match self.start_worker() {
                Ok(w) => started.push(w),
                Err(e) => {
                    tracing::warn!("VMM worker pool: {e}");
                    break;
                }
            }
        }
        for mut w in started {
            if let Err(e) = w.wait_started() {
                tracing::warn!("VMM worker pool: {e}");
                continue;
            }
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            // Spawns may have been served from the pool meanwhile; never exceed what is
            // wanted now (a surplus worker is killed and reaped as it is dropped).
            if idle.len() < want() {
                idle.push(w);
            }
        }
        self.prime_idle();
    }

    /// Prime the idle workers not yet primed for the hot snapshot, a few at a time (taken out
    /// of the pool meanwhile, so no job is handed to one that is priming).
    fn prime_idle(&self) {
        let Some(hot) = self.hot.lock().unwrap_or_else(|p| p.into_inner()).clone() else {
            return;
        };
        // Each worker is looked at once: one that could not prime stays as it is.
        let mut tried = std::collections::HashSet::new();
        loop {
            // Forgotten or replaced by another meanwhile: no more priming for it.
            let still_hot = self
                .hot
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .as_ref()
                .is_some_and(|h| h.job == hot.job);
            if !still_hot {
                return;
            }
            // Before the workers read them: a deletion or replacement while they prime, which
            // `forget` cannot see (they are out of the pool), shows as a change. Files that
            // cannot be read now no worker could prime from.
            let Ok(files) = FileId::of_snapshot(&hot.job.snapshot) else {
                return;
            };
            let mut batch: Vec<Worker> = {
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                let mut batch = Vec::new();
                let mut i = 0;
                while i < idle.len() && batch.len() < PRIME_BATCH {
                    let w = &idle[i];
                    if !w.primed_for(&hot.job.snapshot) && tried.insert(w.pid()) {
                        batch.push(idle.remove(i));
                    } else {
                        i += 1;
                    }
                }
                batch
            };
            if batch.is_empty() {
                return;
            }
            // Sent to all before waiting for any, so they prime side by side.
            batch.retain_mut(|w| match w.send_prime(&hot) {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!("VMM worker pool: priming a worker: {e}");
                    false
                }
            });
            batch.retain_mut(|w| match w.primed_answer(&hot) {
                Ok(primed) => {
                    if !primed {
                        tracing::info!(
                            snapshot = %hot.job.snapshot.display(),
                            "a VMM worker could not prime itself (its job says why)"
                        );
                    }
                    true
                }
                Err(e) => {
                    tracing::warn!("VMM worker pool: priming a worker: {e}");
                    false
                }
            });
            if FileId::of_snapshot(&hot.job.snapshot).ok().as_ref() != Some(&files) {
                // Primed for files that are gone: they would serve no job and keep those open
                // (each dropped is killed and reaped); the unprimed stay.
                batch.retain(|w| !w.primed_for(&hot.job.snapshot));
            }
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            idle.extend(batch);
        }
    }

    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Idle workers primed for the snapshot in `dir`.
    pub fn primed(&self, dir: &Path) -> usize {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.iter().filter(|w| w.primed_for(dir)).count()
    }

    /// The idle workers' process ids.
    pub fn idle_pids(&self) -> Vec<u32> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.iter().map(Worker::pid).collect()
    }
}

/// A spawn in flight ([`WorkerPool::spawning`]).
pub struct Spawning<'a>(&'a WorkerPool);

impl Drop for Spawning<'_> {
    fn drop(&mut self) {
        let mut n = self.0.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.0.quiet.notify_all();
        }
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        // Each idle worker is killed and reaped as it is dropped.
        self.idle
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

/// Every thread of a child's VMM allocates from one malloc arena. glibc otherwise gives each
/// thread that allocates (vCPUs, vsock, control) an arena of its own, whose first pages each
/// child then holds privately; these threads allocate little, and rarely at the same time.
/// It runs first: threads that have allocated keep their arenas, and glibc fixes its arena
/// limit when it first needs a second arena.
fn one_malloc_arena() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets an allocator parameter.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

/// Body of `<worker_exe> __vmm-worker`: wait for a job on stdin (EOF: the daemon went away, exit
/// quietly), restore, signal, run.
pub fn worker_main() -> anyhow::Result<i32> {
    // `__vmm-worker --zygote`: fork workers on request; this returns in each of them.
    if std::env::args_os().nth(2).as_deref()
        == Some(std::ffi::OsStr::new(crate::zygote::ZYGOTE_ARG))
    {
        match crate::zygote::serve().context("serving as the VMM workers' zygote")? {
            crate::zygote::Role::Exit(code) => return Ok(code),
            crate::zygote::Role::Worker => {}
        }
    }
    match run_job()? {
        Outcome::Exit(code) => Ok(code),
        Outcome::Running {
            vm,
            loops,
            control,
            stack,
            give_back_at,
        } => {
            // The job's frames are gone; the thread runs just below this one from now on.
            release_deep_stack(stack);
            crate::control::serve_until_stopped(&control, vm, loops, give_back_at);
            Ok(vm.wait_exit()?.exit_code())
        }
    }
}

/// How [`run_job`] ended.
enum Outcome {
    /// Nothing runs (the daemon went away before a job; a probe): the worker's exit code.
    Exit(i32),
    /// The VM runs: the main thread turns its devices' loops and serves its control socket
    /// until it ends.
    Running {
        vm: &'static tine_vmm::vm::RunningVm,
        loops: Vec<Box<dyn tine_vmm::vm::DeviceLoop>>,
        control: std::os::unix::net::UnixListener,
        stack: std::io::Result<crate::stack::StackMapping>,
        /// When to give back the guest RAM pages held unchanged (the job's setting).
        give_back_at: Option<Instant>,
    },
}

/// The job, up to the VM running. Never inlined into [`worker_main`]: its frame (17 KiB, every
/// page touched on entry) is then below the one the main thread waits in, and given back.
#[inline(never)]
fn run_job() -> anyhow::Result<Outcome> {
    // Its main thread's CPU and page faults per step, from its start (the exec, dynamic
    // loading, Rust's start-up and the command line: "main") to the guest running; pre-start
    // is "main" and "ahead", the rest is per child. Written to vmm.log before the report.
    let mut cpu = tine_vmm::marks::Marks::from_thread_start();
    cpu.mark("main");
    one_malloc_arena();
    // Made while the worker waits, so a restore starts with it (None: the restore makes its
    // own, and says why if that fails too).
    let mut shell = tine_vmm::vm::Shell::new().ok();
    // Likewise what confinement needs of no job: core dumps off, the bounding set, its own
    // mount namespace, the seccomp filters.
    let mut ahead = crate::confine::Ahead::prepare();
    // Where the main thread's stack lies, read now: a read late would leave its buffer's
    // pages in the heap after the restore's.
    let stack = crate::stack::StackMapping::of_this_thread();
    cpu.mark("ahead");
    say(IDLE)?;
    // Orders until the job: the host may first have it prime itself for a snapshot.
    let mut primed: Option<std::result::Result<PrimedWorker, String>> = None;
    let stdin = std_fd(0);
    let mut orders = std::io::BufReader::with_capacity(ORDER_BUFFER, &*stdin);
    let job = loop {
        let mut line = String::new();
        if orders.read_line(&mut line)? == 0 {
            return Ok(Outcome::Exit(0));
        }
        let order: Order = serde_json::from_str(&line).context(
            "bad order from the executor (a worker binary from another build than the executor's?)",
        )?;
        match order {
            Order::Prime(p) => {
                // An earlier priming's VM goes first (its shell is gone: a new one is made).
                drop(primed.take());
                let done = prime(&p, shell.take()).map_err(|e| format!("{e:#}"));
                cpu.mark("prime");
                say(if done.is_ok() { PRIMED } else { NOT_PRIMED })?;
                primed = Some(done);
            }
            Order::Run(job) => break job,
        }
    };
    // Nothing more comes on stdin: its buffer goes back to the heap for what follows.
    drop(orders);
    // From here on our stderr is the child's vmm.log.
    let log = std::fs::File::create(job.dir.join("vmm.log"))?;
    use std::os::fd::AsRawFd;
    // SAFETY: dup2 onto our own stderr descriptor.
    unsafe { libc::dup2(log.as_raw_fd(), 2) };
    // The priming serves this job only if it is for the same snapshot, whose files are the
    // ones primed from. The host sends no held image to a worker primed for the snapshot.
    let (primed, primed_for_it) = match (primed, &job.vm) {
        (Some(Ok(p)), JobVm::Restore { snapshot, memory }) if p.job.snapshot == *snapshot => {
            match p.still_current(*memory) {
                Ok(()) => (Some(p), true),
                Err(why) => {
                    eprintln!(
                        "tine-vmm: primed for {} but {why}: restored from the start",
                        snapshot.display()
                    );
                    (None, true)
                }
            }
        }
        (Some(Ok(p)), _) => {
            eprintln!(
                "tine-vmm: primed for {}, not this job's snapshot: restored from the start",
                p.job.snapshot.display()
            );
            (None, false)
        }
        (Some(Err(why)), _) => {
            eprintln!("tine-vmm: could not prime itself: {why}");
            (None, false)
        }
        (None, _) => (None, false),
    };
    // Taken before any confinement: it arrives on the report socket, and is what the guest's
    // RAM maps.
    let held = match &job.vm {
        JobVm::Restore {
            memory: JobMemory::Held,
            ..
        } if !primed_for_it => {
            use std::os::fd::BorrowedFd;
            // SAFETY: fd 1 is the report socket the host gave us; it stays open for this call.
            let sock = unsafe { BorrowedFd::borrow_raw(1) };
            Some(
                crate::handoff::recv_image(sock, IMAGE_TIMEOUT)
                    .context("taking the memory image from the host")?
                    .context("the host closed the socket before sending the memory image")?,
            )
        }
        _ => None,
    };
    cpu.mark("job");
    // The view step's parts, for vmm.log (see `mark_lines`).
    let mut view_marks = tine_vmm::marks::Marks::from_now();
    // Own session: signals to the daemon's process group do not reach the VM.
    // SAFETY: setsid has no memory effects.
    unsafe { libc::setsid() };
    crate::confine::before_restore(&job.confine, &mut ahead).context("confining the VMM")?;
    view_marks.mark("session");
    let t0 = Instant::now();
    // A VMM that gives up root sees only its own files once it has entered the child's
    // network namespace; one that keeps it goes back to the host's mounts now.
    let linked = primed.as_ref().map(|p| p.linked.clone());
    let view = match (job.confine.user, job.vm.view(linked)) {
        (Some(_), Some(view)) => Some(view),
        _ => None,
    };
    view_marks.mark("linked");
    let mounts = ahead
        .take_mounts(view.is_some())
        .context("confining the VMM")?;
    // The whole VMM lives in the child's namespace (its device threads too), so anything it
    // opens or sends stays on the child's side of the policy.
    let tap = match &job.netns {
        Some(ns) => {
            // Made after this worker's mount namespace was (ip netns mounts it): opened in
            // the host's tree.
            let file = match &mounts {
                Some(m) => m.open_host(ns),
                None => std::fs::File::open(ns),
            }
            .with_context(|| format!("opening {}", ns.display()))?;
            crate::network::enter(&file, ns)?;
            Some(
                tine_vmm::devices::virtio::net::Tap::open(crate::network::TAP)
                    .with_context(|| format!("attaching to the tap in {}", ns.display()))?,
            )
        }
        None => None,
    };
    view_marks.mark("netns");
    let confined_view = match view {
        Some((snapshots, linked)) => {
            crate::confine::view::enter(mounts, &job.dir, snapshots, &linked, &mut view_marks)
                .context("confining the VMM")?;
            true
        }
        None => false,
    };
    let dir = if confined_view {
        PathBuf::from(crate::confine::view::VM_DIR)
    } else {
        job.dir.clone()
    };
    let console = || open_console(Some(&dir.join("console.log")));
    cpu.mark("view");
    let vm = match &job.vm {
        JobVm::Probe { .. } => return probe(&job, t0, ahead).map(Outcome::Exit),
        JobVm::Restore { snapshot, memory } => {
            let snapshot = crate::confine::view::translate(snapshot)?;
            let opts = RestoreOptions {
                console: console()?,
                vsock_uds: Some(dir.join("vsock.sock")),
                tap,
            };
            let vm = match memory {
                JobMemory::Lazy => {
                    let vm = restore_lazily(&snapshot, opts, shell)?;
                    cpu.mark("restore");
                    vm
                }
                JobMemory::Image | JobMemory::Held => match primed {
                    Some(p) => {
                        // Its working set was mapped as it primed itself.
                        let _ = std::io::stderr().write_all(p.prefaulted.as_bytes());
                        // Primed from the host's path: the child's diffs name its parent as it sees it.
                        let vm = p.primed.restore(&snapshot, opts)?;
                        cpu.mark("restore");
                        vm
                    }
                    None => {
                        let prepared = tine_vmm::vm::Prepared { image: held, shell };
                        let vm = Vm::restore_prepared(
                            &snapshot,
                            prepared,
                            opts,
                            tine_vmm::vm::VmOptions::default(),
                        )?;
                        cpu.mark("restore");
                        let line = prefault_working_set(&vm, &snapshot);
                        // One write: the log is unbuffered, so eprintln! would make a system
                        // call of each piece.
                        let _ = std::io::stderr().write_all(line.as_bytes());
                        cpu.mark("prefault");
                        vm
                    }
                },
            };
            if job.merge_pages {
                // The host checked at start that KSM runs; a refusal here costs only memory.
                match vm.ram().advise_mergeable() {
                    Ok(()) => eprintln!("tine-vmm: guest RAM open to page merging (KSM)"),
                    Err(e) => eprintln!("tine-vmm: no page merging: {e}"),
                }
            }
            vm
        }
        JobVm::Boot(b) => {
            let vm = boot(b, &dir, console()?, tap, shell)?;
            cpu.mark("boot");
            vm
        }
    };
    let restore = t0.elapsed();
    let control = crate::control::bind(&dir).context("binding the control socket")?;
    let t1 = Instant::now();
    // Everything the VM needs is open: from here on no guest code runs unconfined.
    tine_vmm::vm::install_signal_handlers()?;
    let mut lock_marks = tine_vmm::marks::Marks::from_now();
    lock_down(&job, ahead, &mut lock_marks)?;
    cpu.mark("lock-down");
    // A copy: starting takes the VM.
    let vm_marks = vm.restore_marks().clone();
    let (running, loops) = vm.start_with_loops()?;
    cpu.mark("start");
    // Before the report, so the line is there once the host has its child; in one write (see
    // prefault_working_set); a log that cannot be written costs the line, never the VM.
    let line = mark_lines("main thread", &cpu)
        + &mark_lines("restore", &vm_marks)
        + &mark_lines("view", &view_marks)
        + &mark_lines("lock-down", &lock_marks);
    let _ = std::io::stderr().write_all(line.as_bytes());
    report(Restored {
        restore,
        start: t1.elapsed(),
    });
    // Never dropped: the process ends with it (its device threads are never joined).
    let running: &'static tine_vmm::vm::RunningVm = Box::leak(Box::new(running));
    // A time past what an Instant holds is never.
    let give_back_at = job
        .give_back_after_ms
        .and_then(|ms| Instant::now().checked_add(Duration::from_millis(ms)));
    Ok(Outcome::Running {
        vm: running,
        loops,
        control,
        stack,
        give_back_at,
    })
}

/// The main thread runs from here on near the top of its stack: the pages the restore took
/// below it go back to the host (see [`crate::stack`]). A failure costs only those pages.
fn release_deep_stack(stack: std::io::Result<crate::stack::StackMapping>) {
    if let Err(e) = stack.and_then(|m| m.release_below_caller()) {
        eprintln!("tine-vmm: the restore's stack pages are kept: {e}");
    }
}

/// `what`'s marks as two vmm.log lines, CPU ms and page faults per step; none without steps
/// (the restore's, see [`Vm::restore_marks`], for a boot).
fn mark_lines(what: &str, m: &tine_vmm::marks::Marks) -> String {
    if m.steps().is_empty() {
        return String::new();
    }
    format!(
        "tine-vmm: {what} CPU ms: {}\ntine-vmm: {what} page faults: {}\n",
        m.cpu_ms(),
        m.faults()
    )
}

/// Say `b` to the host on the report socket.
fn say(b: u8) -> std::io::Result<()> {
    (&*std_fd(1)).write_all(&[b])
}

/// The job's line is read through a buffer this size (a longer line takes more reads).
const ORDER_BUFFER: usize = 1024;

/// Standard descriptor `fd` as a file that never closes it, read and written without std's
/// stdin and stdout: their buffers (8 KiB and 1 KiB) are made on first use and kept for the
/// life of the process, in every child's VMM.
fn std_fd(fd: std::os::fd::RawFd) -> std::mem::ManuallyDrop<std::fs::File> {
    use std::os::fd::FromRawFd;
    // SAFETY: 0 and 1 are the worker's pipe and report socket, open for its whole life (report
    // closes 1 last); ManuallyDrop never closes them.
    std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) })
}

/// A restore made ahead for the snapshot of [`PrimeJob`] `job`.
struct PrimedWorker {
    job: PrimeJob,
    /// Of its header and state as primed from.
    files: [FileId; 2],
    primed: tine_vmm::vm::Primed,
    /// The prefault's vmm.log line.
    prefaulted: String,
    /// The files outside the snapshots directory its view must show (see `JobVm::view`),
    /// looked up as it primed: those it primed from.
    linked: Vec<PathBuf>,
}

/// What tells one version of a file from another: a snapshot replaced under the same name has
/// new files (written anew, then renamed into place).
#[derive(Debug, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    ctime: (i64, i64),
}

impl FileId {
    fn of(path: &Path) -> std::io::Result<FileId> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(path)?;
        Ok(FileId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }

    fn of_snapshot(dir: &Path) -> std::io::Result<[FileId; 2]> {
        use tine_vmm::snapshot::file::{HEADER_FILE, STATE_FILE};
        Ok([
            FileId::of(&dir.join(HEADER_FILE))?,
            FileId::of(&dir.join(STATE_FILE))?,
        ])
    }
}

impl PrimedWorker {
    /// Whether it can serve a job for its snapshot with `memory`: not lazy, and the files are
    /// those it primed from.
    fn still_current(&self, memory: JobMemory) -> std::result::Result<(), String> {
        if memory == JobMemory::Lazy {
            return Err("the job restores lazily".into());
        }
        match FileId::of_snapshot(&self.job.snapshot) {
            Ok(now) if now == self.files => Ok(()),
            Ok(_) => Err("the snapshot was replaced since".into()),
            Err(e) => Err(format!("its files cannot be read now ({e})")),
        }
    }
}

/// Restore `p`'s snapshot up to what needs the child, and map its working set, while the
/// worker waits (reading the host's files: the worker has no view yet).
fn prime(p: &PrimeJob, shell: Option<tine_vmm::vm::Shell>) -> anyhow::Result<PrimedWorker> {
    let image = match p.memory {
        JobMemory::Image => None,
        JobMemory::Held => {
            use std::os::fd::BorrowedFd;
            // SAFETY: fd 1 is the report socket the host gave us; it stays open for this call.
            let sock = unsafe { BorrowedFd::borrow_raw(1) };
            Some(
                crate::handoff::recv_image(sock, IMAGE_TIMEOUT)
                    .context("taking the memory image from the host")?
                    .context("the host closed the socket before sending the memory image")?,
            )
        }
        JobMemory::Lazy => anyhow::bail!("a lazily restored child is not primed"),
    };
    // Before reading them, so a change while priming shows as one.
    let files = FileId::of_snapshot(&p.snapshot)
        .with_context(|| format!("reading {}", p.snapshot.display()))?;
    let primed = Vm::prime(
        &p.snapshot,
        tine_vmm::vm::Prepared { image, shell },
        tine_vmm::vm::VmOptions::default(),
    )?;
    let prefaulted = prefault_working_set(primed.vm(), &p.snapshot);
    let linked = match p.snapshot.parent() {
        Some(snapshots) => crate::confine::view::linked_files(&p.snapshot, snapshots),
        None => Vec::new(),
    };
    Ok(PrimedWorker {
        job: p.clone(),
        files,
        primed,
        prefaulted,
        linked,
    })
}

/// Map the snapshot's recorded working set before the guest runs, copying the pages a child
/// writes on its way to ready, so those first touches do not each cost an exit. A lazy
/// restore has none to map (its pages arrive through the userfaultfd). Returns the outcome's
/// vmm.log line (empty: no working set).
fn prefault_working_set(vm: &Vm, snapshot: &Path) -> String {
    use crate::lazy::{load_page_list, WORKING_SET_FILE, WRITTEN_SET_FILE};
    let pages = vm.ram().size() / 4096;
    let Some(touched) = load_page_list(snapshot, WORKING_SET_FILE, pages) else {
        return String::new();
    };
    let written = load_page_list(snapshot, WRITTEN_SET_FILE, pages).unwrap_or_default();
    let done = vm.prefault(&touched, &written);
    let method = done.method.map_or("none", |m| m.as_str());
    format!(
        "tine-vmm: prefaulted {} pages in {} runs ({method}), {} copied ahead in {} us, all in {} us{}\n",
        done.pages,
        done.runs,
        done.copied,
        done.copy_took.as_micros(),
        done.took.as_micros(),
        done.error.map(|e| format!("; {e}")).unwrap_or_default()
    )
}

/// Confine the worker (see [`crate::confine`]). Tests only: then make a call outside the
/// allow-list if the job says so.
fn lock_down(
    job: &WorkerJob,
    ahead: crate::confine::Ahead,
    marks: &mut tine_vmm::marks::Marks,
) -> anyhow::Result<()> {
    crate::confine::lock_down(&job.confine, ahead, marks).context("confining the VMM")?;
    #[cfg(feature = "testing")]
    if job.trip_seccomp {
        // SAFETY: a call that is refused before it does anything.
        unsafe { libc::syscall(libc::SYS_ptrace, 0, 0, 0, 0) };
    }
    Ok(())
}

/// A probe's end: confined as a VMM would be, with /dev/kvm usable in its view, it reports and
/// exits.
fn probe(job: &WorkerJob, t0: Instant, ahead: crate::confine::Ahead) -> anyhow::Result<i32> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .context("opening /dev/kvm in its view")?;
    lock_down(job, ahead, &mut tine_vmm::marks::Marks::from_now())?;
    report(Restored {
        restore: t0.elapsed(),
        start: Duration::ZERO,
    });
    Ok(0)
}

/// Tell the host the guest runs, then close stdout so its end sees EOF if it reads again.
fn report(done: Restored) {
    let _ = (&*std_fd(1)).write_all(&done.encode());
    // SAFETY: closing our own stdout descriptor; nothing writes to it afterwards.
    unsafe { libc::close(1) };
}

/// A parent's VM, its kernel loaded (shown at its own path in a confined view).
fn boot(
    b: &BootJob,
    dir: &Path,
    console: Box<dyn Write + Send>,
    tap: Option<tine_vmm::devices::virtio::net::Tap>,
    shell: Option<tine_vmm::vm::Shell>,
) -> anyhow::Result<Vm> {
    let mut vm = Vm::create_prepared(
        b.vcpus,
        tine_vmm::GuestRam::new_memfd(b.mem_mib)?,
        console,
        tine_vmm::vm::VmOptions::default(),
        shell,
    )?;
    vm.add_vsock(3, &dir.join("vsock.sock"))?;
    if let Some(tap) = tap {
        // After vsock: the device order is part of every snapshot of this parent.
        vm.add_net(crate::network::GUEST_MAC, Some(tap))?;
    }
    vm.load_linux(&tine_vmm::LinuxBoot {
        kernel: b.kernel.clone(),
        initrd: b.initrd.clone(),
        cmdline: b.cmdline.clone(),
    })?;
    Ok(vm)
}

/// Restore onto anonymous RAM registered with a userfaultfd that goes to the host before
/// anything touches guest memory: every first touch, by the guest or by this VMM, waits for
/// the host to supply the page.
fn restore_lazily(
    dir: &Path,
    opts: RestoreOptions,
    shell: Option<tine_vmm::vm::Shell>,
) -> anyhow::Result<Vm> {
    use std::os::fd::{AsFd, BorrowedFd};
    let loaded = tine_vmm::snapshot::file::load_state(dir)?;
    let ram = tine_vmm::memory::GuestRam::new_anonymous(loaded.header.mem_size)?;
    let uffd = userfaultfd::UffdBuilder::new()
        .close_on_exec(true)
        .non_blocking(true)
        // KVM touches guest RAM from the kernel (get_user_pages): those faults must reach us.
        .user_mode_only(false)
        .create()
        .context(
            "creating a userfaultfd (needs CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1)",
        )?;
    let mut ranges = Vec::new();
    for (r, host_addr) in ram.host_ranges()? {
        uffd.register(host_addr as *mut libc::c_void, r.size as usize)
            .with_context(|| {
                format!(
                    "registering guest RAM at {:#x} with the userfaultfd",
                    r.guest_addr
                )
            })?;
        ranges.push(crate::handoff::MappedRange {
            guest_addr: r.guest_addr,
            size: r.size,
            image_offset: r.file_offset,
            host_addr,
        });
    }
    // SAFETY: fd 1 is the report socket the host gave us; it stays open for this call.
    let sock = unsafe { BorrowedFd::borrow_raw(1) };
    crate::handoff::send(sock, uffd.as_fd(), &ranges).context("handing guest RAM to the host")?;
    // Kept open for the life of this process: were the host's copy the last one, a host that
    // died would unregister the ranges and the guest's missing pages would silently read as
    // zeros. With ours open they wait instead (and the next daemon kills this VM).
    std::mem::forget(uffd);
    Ok(Vm::restore_onto(
        dir,
        loaded.state,
        ram,
        opts,
        tine_vmm::vm::VmOptions::default(),
        shell,
    )?)
}
