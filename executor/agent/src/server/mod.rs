//! The guest side: accepts connections and serves one request per connection,
//! on a standing thread when it is idle, else on a thread of its own.

pub mod exec;
pub mod files;
#[cfg(feature = "hostile")]
pub mod hostile;
pub mod init;
pub mod listen;
pub mod modules;
pub mod network;
pub mod python;
pub mod reaper;
pub mod system;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use crate::frame::{read_message, write_message, FrameError};
use crate::pb::{self, request, response::Kind};
use listen::{Conn, Listener};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Warming,
    Ready,
    Failed(String),
}

pub struct Agent {
    started: Instant,
    readiness: Mutex<Readiness>,
    /// Time since `started` at which readiness became Ready (Ping's `ready_ms`).
    ready_at: std::sync::OnceLock<std::time::Duration>,
    python: python::Interpreter,
}

/// The standing handler thread: it takes a connection only while idle.
struct Standing {
    idle: Arc<AtomicBool>,
    tx: mpsc::Sender<Conn>,
}

impl Standing {
    fn start(agent: Arc<Agent>) -> std::io::Result<Self> {
        let idle = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<Conn>();
        let flag = Arc::clone(&idle);
        std::thread::Builder::new()
            .name("standing".into())
            .spawn(move || {
                flag.store(true, Ordering::Release);
                while let Ok(mut conn) = rx.recv() {
                    // A call that panics ends that call, not the standing thread.
                    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        agent.handle(&mut conn)
                    }));
                    // Idle again before the connection closes: a host that waits for the close
                    // after PrepareSnapshot's answer snapshots it idle, so clones have it free.
                    flag.store(true, Ordering::Release);
                    drop(conn);
                }
            })?;
        Ok(Self { idle, tx })
    }

    /// Hands `conn` to the standing thread if it is idle; gives it back otherwise.
    fn offer(&self, conn: Conn) -> Result<(), Conn> {
        // Only the accept loop clears the flag, once per connection it hands over, so the
        // thread is given at most one at a time.
        if !self.idle.swap(false, Ordering::AcqRel) {
            return Err(conn);
        }
        self.tx.send(conn).map_err(|mpsc::SendError(conn)| conn)
    }
}

impl Agent {
    pub fn new(config: &crate::config::AgentConfig) -> Arc<Self> {
        let ready_at = std::sync::OnceLock::new();
        let readiness = if config.warmup.trim().is_empty() {
            let _ = ready_at.set(std::time::Duration::ZERO);
            Readiness::Ready
        } else {
            Readiness::Warming
        };
        Arc::new(Self {
            started: Instant::now(),
            readiness: Mutex::new(readiness),
            ready_at,
            python: python::Interpreter::new(config.python.clone(), config.warmup.clone()),
        })
    }

    /// Runs the configured warm-up in the background; Ping reports `warming`
    /// until it completes. Without a warm-up the agent is ready immediately
    /// and the interpreter starts on the first Eval.
    pub fn start_warmup(self: &Arc<Self>) {
        if self.python.warmup_code().trim().is_empty() {
            return;
        }
        let agent = Arc::clone(self);
        std::thread::spawn(move || {
            let state = match agent.python.warm_up() {
                Ok(()) => {
                    let _ = agent.ready_at.set(agent.started.elapsed());
                    Readiness::Ready
                }
                Err(e) => {
                    eprintln!("tine-agent: warm-up failed: {e:#}");
                    Readiness::Failed(format!("{e:#}"))
                }
            };
            *agent.readiness.lock().unwrap_or_else(|e| e.into_inner()) = state;
        });
    }

    pub fn readiness(&self) -> Readiness {
        self.readiness
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Accept loop; returns only if accepting fails persistently.
    ///
    /// One handler thread stands ready, started before any snapshot is taken. A clone's first
    /// call (the Wake) then runs on a thread it already has: a new thread costs a clone about
    /// 0.2 MiB of its own guest pages (the thread's kernel objects, stacks and mappings;
    /// docs/performance.md). Calls that come while it is busy get a thread each, as before.
    pub fn serve(self: &Arc<Self>, listener: &Listener) -> std::io::Result<()> {
        let standing = Standing::start(Arc::clone(self))?;
        let mut consecutive_errors = 0;
        loop {
            match listener.accept() {
                Ok(conn) => {
                    consecutive_errors = 0;
                    if let Err(mut conn) = standing.offer(conn) {
                        let agent = Arc::clone(self);
                        std::thread::spawn(move || agent.handle(&mut conn));
                    }
                }
                Err(e) => {
                    // EMFILE and friends are transient; a dead listener is not.
                    consecutive_errors += 1;
                    eprintln!("tine-agent: accept: {e}");
                    if consecutive_errors > 100 {
                        return Err(e);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    fn handle(&self, conn: &mut Conn) {
        if let Err(e) = self.dispatch(conn) {
            let message = format!("{e:#}");
            let code = error_code(&e) as i32;
            // Best effort: the peer may already be gone.
            let _ = write_message(
                conn,
                &pb::Response {
                    kind: Some(Kind::Error(pb::Error { message, code })),
                },
            );
        }
    }

    fn dispatch(&self, conn: &mut Conn) -> anyhow::Result<()> {
        let req: pb::Request = match read_message(conn) {
            Ok(r) => r,
            Err(FrameError::Closed) => return Ok(()),
            Err(e @ FrameError::Decode(_)) => anyhow::bail!("malformed request: {e}"),
            Err(e) => return Err(e.into()),
        };
        let reply = |conn: &mut Conn, kind: Kind| -> anyhow::Result<()> {
            write_message(conn, &pb::Response { kind: Some(kind) })?;
            Ok(())
        };
        match req.kind {
            Some(request::Kind::Ping(_)) => reply(conn, Kind::Ping(self.ping())),
            #[cfg(feature = "hostile")]
            Some(request::Kind::Exec(r))
                if r.argv.first().map(String::as_str) == Some(hostile::ARGV0) =>
            {
                hostile::exec(&r.argv, conn)
            }
            #[cfg(feature = "hostile")]
            Some(request::Kind::WriteFile(r)) if r.path == hostile::NEVER_READ_PATH => {
                hostile::never_read(conn)
            }
            Some(request::Kind::Exec(r)) => exec::run(r, conn),
            Some(request::Kind::WriteFile(r)) => files::write(r, conn),
            Some(request::Kind::ReadFile(r)) => files::read(r, conn),
            Some(request::Kind::ListDir(r)) => files::list(r, conn),
            Some(request::Kind::Eval(r)) => {
                let timeout = (r.timeout_ms > 0).then(|| Duration::from_millis(r.timeout_ms));
                let resp = self.python.eval(&r.code, timeout)?;
                reply(conn, Kind::Eval(resp))
            }
            Some(request::Kind::SetTime(r)) => {
                system::set_time(r.unix_nanos)?;
                reply(conn, Kind::SetTime(pb::SetTimeResponse {}))
            }
            Some(request::Kind::Reseed(r)) => {
                let credited = system::add_entropy(&r.entropy)?;
                let identity_set = !r.hostname.is_empty();
                if identity_set {
                    system::set_identity(&r.hostname, &r.machine_id)?;
                }
                let python_reseeded = self.python.reseed()?;
                reply(
                    conn,
                    Kind::Reseed(pb::ReseedResponse {
                        credited,
                        python_reseeded,
                        identity_set,
                    }),
                )
            }
            Some(request::Kind::Wake(r)) => {
                anyhow::ensure!(r.unix_nanos > 0, "wake: unix_nanos must be set");
                anyhow::ensure!(!r.entropy.is_empty(), "wake: entropy must not be empty");
                system::set_time(r.unix_nanos)?;
                let credited = system::add_entropy(&r.entropy)?;
                let identity_set = !r.hostname.is_empty();
                if identity_set {
                    system::set_identity(&r.hostname, &r.machine_id)?;
                }
                let python_reseed_pending = self.python.reseed_before_next_eval();
                reply(
                    conn,
                    Kind::Wake(pb::WakeResponse {
                        ping: Some(self.ping()),
                        credited,
                        identity_set,
                        python_reseed_pending,
                    }),
                )
            }
            Some(request::Kind::PrepareSnapshot(_)) => {
                // First: the collection frees memory the kernel then finds free.
                let frozen = self.python.prepare_snapshot()?.unwrap_or(0);
                let (before, after) = system::prepare_snapshot()?;
                reply(
                    conn,
                    Kind::PrepareSnapshot(pb::PrepareSnapshotResponse {
                        free_kib_before: before,
                        free_kib_after: after,
                        python_objects_frozen: frozen,
                    }),
                )
            }
            Some(request::Kind::FileChunk(_)) => {
                anyhow::bail!("file_chunk is only valid after write_file")
            }
            None => anyhow::bail!(
                "{} (this agent, version {VERSION}, understands ping, exec, write_file, \
                 read_file, list_dir, eval, set_time, reseed, prepare_snapshot, wake)",
                crate::client::UNKNOWN_REQUEST
            ),
        }
    }

    fn ping(&self) -> pb::PingResponse {
        let state = self.readiness();
        let ready_ms = match state {
            Readiness::Ready => self.ready_at.get().map(|d| d.as_millis() as u64),
            _ => None,
        };
        let (readiness, warmup_error) = match state {
            Readiness::Ready => (pb::Readiness::Ready, String::new()),
            Readiness::Warming => (pb::Readiness::Warming, String::new()),
            Readiness::Failed(e) => (pb::Readiness::Failed, e),
        };
        pb::PingResponse {
            agent_version: VERSION.to_owned(),
            uptime_ms: self.started.elapsed().as_millis() as u64,
            readiness: readiness as i32,
            warmup_error,
            warmup_command: self.python.warmup_code().to_owned(),
            ready_ms,
        }
    }
}

/// Classify a failure by the first I/O or path error in its chain.
fn error_code(e: &anyhow::Error) -> pb::ErrorCode {
    for cause in e.chain() {
        if cause.downcast_ref::<crate::paths::PathError>().is_some() {
            return pb::ErrorCode::InvalidArgument;
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::NotFound => pb::ErrorCode::NotFound,
                std::io::ErrorKind::PermissionDenied => pb::ErrorCode::PermissionDenied,
                std::io::ErrorKind::AlreadyExists => pb::ErrorCode::AlreadyExists,
                std::io::ErrorKind::InvalidInput => pb::ErrorCode::InvalidArgument,
                _ => pb::ErrorCode::Unspecified,
            };
        }
    }
    pb::ErrorCode::Unspecified
}
