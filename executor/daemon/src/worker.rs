//! Pre-started VMM worker processes. The daemon is multi-threaded, so it must not fork(2)
//! VMMs itself; instead it keeps a few `tine __vmm-worker` processes started and waiting,
//! and hands one a snapshot when a child is asked for: process creation, exec and dynamic
//! loading are off the spawn critical path. Each child is still its own process.
//!
//! Protocol: the daemon writes one JSON line (`WorkerJob`) to the worker's stdin; the worker
//! restores the snapshot, writes one byte to stdout once the guest runs and its vsock socket
//! exists, then runs the VM until it stops and exits with the VM's exit code.

use std::io::{BufRead, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use tine_vmm::vm::RestoreOptions;
use tine_vmm::Vm;

use crate::console::open_console;
use crate::vms::{self, VmMeta};

/// The hidden subcommand that runs `worker_main`.
pub const WORKER_SUBCOMMAND: &str = "__vmm-worker";

#[derive(Debug, Serialize, Deserialize)]
pub struct WorkerJob {
    pub snapshot: PathBuf,
    /// The child's directory: console.log, vmm.log, vsock.sock.
    pub dir: PathBuf,
}

/// A started worker waiting for its job.
pub struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: OwnedFd,
}

impl Worker {
    fn start(exe: &Path) -> Result<Worker> {
        let mut child = Command::new(exe)
            .arg(WORKER_SUBCOMMAND)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {} {WORKER_SUBCOMMAND}", exe.display()))?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout").into();
        Ok(Worker {
            child,
            stdin,
            stdout,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Hand over the job. Returns the process (to reap) and the "restored" signal pipe.
    pub fn run(mut self, job: &WorkerJob) -> Result<(Child, std::fs::File)> {
        let mut line = serde_json::to_vec(job)?;
        line.push(b'\n');
        self.stdin
            .write_all(&line)
            .context("handing the job to a VMM worker")?;
        drop(self.stdin);
        Ok((self.child, std::fs::File::from(self.stdout)))
    }
}

/// Keeps `target` idle workers started.
pub struct WorkerPool {
    exe: PathBuf,
    target: usize,
    /// Start a replacement in the background whenever one is taken (a daemon), or only when
    /// asked (a one-shot fork that pre-starts all it needs before its clock starts).
    auto_refill: bool,
    idle: Mutex<Vec<Worker>>,
}

impl WorkerPool {
    pub fn new(exe: PathBuf, target: usize) -> Arc<WorkerPool> {
        Arc::new(WorkerPool {
            exe,
            target,
            auto_refill: true,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// A pool that starts `n` workers now and never more on its own.
    pub fn prestarted(exe: PathBuf, n: usize) -> Arc<WorkerPool> {
        let pool = Arc::new(WorkerPool {
            exe,
            target: n,
            auto_refill: false,
            idle: Mutex::new(Vec::new()),
        });
        pool.refill();
        pool
    }

    /// An idle worker, or a freshly started one when the pool is empty.
    pub fn take(self: &Arc<Self>) -> Result<Worker> {
        let w = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let w = match w {
            Some(w) => w,
            None => Worker::start(&self.exe)?,
        };
        if self.auto_refill {
            let pool = self.clone();
            std::thread::spawn(move || pool.refill());
        }
        Ok(w)
    }

    /// Start workers until `target` are idle.
    pub fn refill(&self) {
        loop {
            if self.idle.lock().unwrap_or_else(|p| p.into_inner()).len() >= self.target {
                return;
            }
            match Worker::start(&self.exe) {
                Ok(w) => self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(w),
                Err(e) => {
                    tracing::warn!("VMM worker pool: {e:#}");
                    return;
                }
            }
        }
    }

    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Drop for WorkerPool {
    fn drop(&mut self) {
        for mut w in self
            .idle
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
    }
}

/// A child VMM that was handed its snapshot and is restoring.
pub struct Started {
    pub dir: PathBuf,
    pub pid: u32,
    /// Reap it (or drop it to leave it running).
    pub child: Child,
    /// One byte arrives once the guest runs; EOF if the worker failed first.
    pub restored: std::fs::File,
}

/// Create the child's directory (`vms/<id>` with meta.json) and hand a worker the snapshot.
pub fn start_child(
    pool: &Arc<WorkerPool>,
    tag: &str,
    snapshot: &Path,
    id: &str,
) -> std::result::Result<Started, String> {
    let dir = vms::vms_dir().map_err(|e| e.to_string())?.join(id);
    if dir.exists() {
        return Err(format!("sandbox {id} exists already"));
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let worker = pool.take().map_err(|e| format!("{e:#}"))?;
    let pid = worker.pid();
    vms::write_meta(
        &dir,
        &VmMeta {
            id: id.to_string(),
            pid,
            tag: Some(tag.to_string()),
            created_unix_ms: vms::now_ms(),
        },
    )
    .map_err(|e| format!("{e:#}"))?;
    let (child, restored) = worker
        .run(&WorkerJob {
            snapshot: snapshot.to_path_buf(),
            dir: dir.clone(),
        })
        .map_err(|e| format!("{e:#}"))?;
    Ok(Started {
        dir,
        pid,
        child,
        restored,
    })
}

/// Body of `tine __vmm-worker`: wait for a job on stdin (EOF: the daemon went away, exit
/// quietly), restore, signal, run.
pub fn worker_main() -> Result<i32> {
    let mut line = String::new();
    if std::io::stdin().lock().read_line(&mut line)? == 0 {
        return Ok(0);
    }
    let job: WorkerJob = serde_json::from_str(&line).context("bad job from the executor")?;
    // From here on our stderr is the child's vmm.log.
    let log = std::fs::File::create(job.dir.join("vmm.log"))?;
    use std::os::fd::AsRawFd;
    // SAFETY: dup2 onto our own stderr descriptor.
    unsafe { libc::dup2(log.as_raw_fd(), 2) };
    // Own session: signals to the daemon's process group do not reach the VM.
    // SAFETY: setsid has no memory effects.
    unsafe { libc::setsid() };
    let vm = Vm::restore(
        &job.snapshot,
        RestoreOptions {
            console: open_console(Some(&job.dir.join("console.log")))?,
            vsock_uds: Some(job.dir.join("vsock.sock")),
        },
    )?;
    let running = vm.start()?;
    {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(b"1");
        let _ = out.flush();
    }
    // Close stdout so the daemon's pipe sees EOF if it reads again.
    // SAFETY: closing our own stdout descriptor; nothing writes to it afterwards.
    unsafe { libc::close(1) };
    let exit = running.wait()?;
    Ok(exit.exit_code())
}
