//! The executor API (tine.executor.v1) over this host's VMM: snapshots under the data
//! directory, children restored by pre-started worker processes, agent calls relayed.

use std::collections::HashMap;
use std::io::Read;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::Stream;
use tine_agent::client::{AgentErrorCode, ClientError, ExecOptions};
use tine_control_plane::validate;
use tine_proto::executor::v1 as xpb;
use tine_proto::executor::v1::executor_server::Executor;
use tine_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::parent::{self, ParentSpec};
use crate::ready::{agent, make_ready};
use crate::vms;
use crate::worker::{start_child, Started, WorkerPool};

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

const CHUNK: usize = 1 << 20;

/// A child this executor runs.
struct Sandbox {
    tag: String,
    dir: PathBuf,
    pid: u32,
    /// Our own child process (None for one adopted after a daemon restart).
    child: Option<Child>,
}

pub struct State {
    pub id: String,
    pub max_sandboxes: u32,
    /// Refuse VM work on a PVM /dev/kvm (Linux guests cannot run there).
    pub vm_refusal: Option<String>,
    pool: Arc<WorkerPool>,
    live: Mutex<HashMap<String, Sandbox>>,
}

fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

fn agent_status(e: ClientError) -> Status {
    match e {
        ClientError::Agent(m, code) => {
            let m = format!("guest agent: {m}");
            match code {
                AgentErrorCode::NotFound => Status::not_found(m),
                AgentErrorCode::PermissionDenied => Status::permission_denied(m),
                AgentErrorCode::InvalidArgument => Status::invalid_argument(m),
                AgentErrorCode::AlreadyExists => Status::already_exists(m),
                AgentErrorCode::Unspecified => Status::failed_precondition(m),
            }
        }
        other => Status::unavailable(format!("guest agent: {other}")),
    }
}

impl State {
    pub fn new(
        id: String,
        max_sandboxes: u32,
        pool: Arc<WorkerPool>,
        vm_refusal: Option<String>,
    ) -> Arc<State> {
        let state = Arc::new(State {
            id,
            max_sandboxes,
            vm_refusal,
            pool,
            live: Mutex::new(HashMap::new()),
        });
        state.adopt_survivors();
        state
    }

    /// After a daemon restart: take back the children still running from a previous life.
    fn adopt_survivors(&self) {
        let Ok(list) = vms::list() else { return };
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        for (dir, m) in list {
            if m.id.starts_with("sbx-") && vms::alive(m.pid) {
                tracing::info!(id = %m.id, pid = m.pid, "re-adopting a running sandbox");
                live.insert(
                    m.id.clone(),
                    Sandbox {
                        tag: m.tag.unwrap_or_default(),
                        dir,
                        pid: m.pid,
                        child: None,
                    },
                );
            }
        }
    }

    pub fn live_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        ids.sort();
        ids
    }

    pub fn report(&self) -> pb::ExecutorReport {
        let (total, avail) = meminfo();
        let live = self.live_ids();
        pb::ExecutorReport {
            capacity: Some(pb::Capacity {
                max_sandboxes: self.max_sandboxes,
                running_sandboxes: live.len() as u32,
                mem_total_mib: total,
                mem_available_mib: avail,
            }),
            cached_tags: parent::local_tags().unwrap_or_default(),
            live_sandboxes: live,
        }
    }

    fn sandbox_dir(&self, id: &str) -> Result<PathBuf, Status> {
        validate::name("sandbox_id", id)?;
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .map(|s| s.dir.clone())
            .ok_or_else(|| {
                Status::not_found(format!("sandbox {id} does not run on executor {}", self.id))
            })
    }

    fn refuse_vm_work(&self) -> Result<(), Status> {
        match &self.vm_refusal {
            Some(why) => Err(Status::failed_precondition(why.clone())),
            None => Ok(()),
        }
    }

    /// Restore one child and wait for its agent. Returns spawn-to-ready.
    fn spawn_one(
        &self,
        tag: &str,
        snapshot: PathBuf,
        id: &str,
        timeout: Duration,
    ) -> Result<Duration, String> {
        let t = Instant::now();
        let Started {
            dir,
            pid,
            child,
            restored,
        } = start_child(&self.pool, tag, &snapshot, id)?;
        self.live.lock().unwrap_or_else(|p| p.into_inner()).insert(
            id.to_string(),
            Sandbox {
                tag: tag.to_string(),
                dir: dir.clone(),
                pid,
                child: Some(child),
            },
        );
        match make_ready(&dir, pid, restored, timeout) {
            Ok(()) => Ok(t.elapsed()),
            Err(e) => {
                self.kill(id);
                Err(e)
            }
        }
    }

    /// Kill a child and remove its directory; false if it was not ours.
    pub fn kill(&self, id: &str) -> bool {
        let Some(mut s) = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(id)
        else {
            return false;
        };
        // SAFETY: kill(2) of a pid we started (or re-adopted after checking it runs).
        unsafe { libc::kill(s.pid as i32, libc::SIGKILL) };
        if let Some(c) = s.child.as_mut() {
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&s.dir);
        tracing::debug!(id, tag = %s.tag, "sandbox killed");
        true
    }

    /// Forget children whose VMM exited (logging why), reaping our own processes.
    pub fn reap(&self) {
        let mut gone = Vec::new();
        {
            let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
            live.retain(|id, s| {
                let exited = match s.child.as_mut() {
                    Some(c) => match c.try_wait() {
                        Ok(Some(status)) => Some(format!("{status}")),
                        _ => None,
                    },
                    None => (!vms::alive(s.pid)).then(|| "exited".to_string()),
                };
                match exited {
                    Some(how) => {
                        gone.push((id.clone(), s.dir.clone(), how));
                        false
                    }
                    None => true,
                }
            });
        }
        for (id, dir, how) in gone {
            let log = std::fs::read_to_string(dir.join("vmm.log")).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(5).collect();
            tracing::warn!(%id, %how, vmm_log = %tail.into_iter().rev().collect::<Vec<_>>().join(" | "), "sandbox VMM exited");
            let _ = std::fs::remove_dir_all(&dir);
        }
    }

    pub fn kill_all(&self) {
        for id in self.live_ids() {
            self.kill(&id);
        }
    }
}

/// (MemTotal, MemAvailable) in MiB.
fn meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(0, |kib| kib / 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

#[derive(Clone)]
pub struct ExecutorService {
    pub state: Arc<State>,
}

/// Feeds a blocking `Read` (the agent upload) from the gRPC stream; an error in the
/// stream becomes a read error, so a broken upload is never committed.
struct ChannelReader {
    rx: std::sync::mpsc::Receiver<Result<Vec<u8>, String>>,
    buf: Vec<u8>,
    pos: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.buf.len() {
            match self.rx.recv() {
                Ok(Ok(b)) => {
                    self.buf = b;
                    self.pos = 0;
                }
                Ok(Err(e)) => return Err(std::io::Error::other(e)),
                Err(_) => return Ok(0), // sender done: end of data
            }
        }
        let n = out.len().min(self.buf.len() - self.pos);
        out[..n].copy_from_slice(&self.buf[self.pos..self.pos + n]);
        self.pos += n;
        Ok(n)
    }
}

/// Sends what the agent writes as FileChunk messages.
struct ChunkWriter {
    tx: mpsc::Sender<Result<pb::FileChunk, Status>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn send(&mut self, chunk: pb::FileChunk) -> std::io::Result<()> {
        self.tx
            .blocking_send(Ok(chunk))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "caller went away"))
    }
}

impl std::io::Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            let data = std::mem::take(&mut self.buf);
            self.send(pb::FileChunk {
                data,
                mode: 0,
                size: 0,
            })?;
        }
        Ok(data.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tonic::async_trait]
impl Executor for ExecutorService {
    type SpawnStream = ReceiverStream<Result<xpb::SpawnEvent, Status>>;
    type ExecStream = BoxStream<pb::ExecEvent>;
    type ReadFileStream = BoxStream<pb::FileChunk>;

    async fn info(
        &self,
        _: Request<xpb::InfoRequest>,
    ) -> Result<Response<pb::ExecutorReport>, Status> {
        let st = self.state.clone();
        let r = tokio::task::spawn_blocking(move || st.report())
            .await
            .map_err(internal)?;
        Ok(Response::new(r))
    }

    async fn create_snapshot(
        &self,
        req: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        self.state.refuse_vm_work()?;
        let r = req.into_inner();
        validate::name("tag", &r.tag)?;
        validate::name("image", &r.image)?;
        let vcpus = u8::try_from(r.vcpus.max(1))
            .map_err(|_| Status::invalid_argument("vcpus: at most 255"))?;
        let spec = ParentSpec {
            image: r.image.clone(),
            tag: r.tag.clone(),
            vcpus,
            mem_mib: (r.mem_mib != 0).then_some(r.mem_mib),
            evals: r.warmup_eval.clone(),
            ready_timeout: Duration::from_secs(900),
            replace: false,
        };
        let made = tokio::task::spawn_blocking(move || parent::create_snapshot(&spec))
            .await
            .map_err(internal)?
            .map_err(|e| {
                let msg = format!("{e:#}");
                if msg.contains("already exists") {
                    Status::already_exists(msg)
                } else {
                    Status::failed_precondition(msg)
                }
            })?;
        Ok(Response::new(pb::Snapshot {
            tag: r.tag,
            parent_tag: String::new(),
            image: r.image,
            vcpus: made.header.vcpus as u32,
            mem_mib: made.header.mem_size >> 20,
            created_unix_ms: vms::now_ms() as i64,
            executors: vec![self.state.id.clone()],
            source_sandbox: String::new(),
        }))
    }

    async fn delete_snapshot(
        &self,
        req: Request<xpb::DeleteSnapshotRequest>,
    ) -> Result<Response<xpb::DeleteSnapshotResponse>, Status> {
        let tag = req.into_inner().tag;
        validate::name("tag", &tag)?;
        let dir = vms::snapshot_dir(&tag).map_err(internal)?;
        let existed = dir.exists();
        if existed {
            // Running children keep their mapping of the memory image; only the name goes.
            std::fs::remove_dir_all(&dir)
                .map_err(|e| internal(format!("removing {}: {e}", dir.display())))?;
        }
        Ok(Response::new(xpb::DeleteSnapshotResponse { existed }))
    }

    async fn spawn(
        &self,
        req: Request<xpb::SpawnRequest>,
    ) -> Result<Response<Self::SpawnStream>, Status> {
        self.state.refuse_vm_work()?;
        let r = req.into_inner();
        validate::name("tag", &r.tag)?;
        if r.ids.is_empty() || r.ids.len() > validate::MAX_SPAWN as usize {
            return Err(Status::invalid_argument(format!(
                "ids: give 1..={} sandbox ids",
                validate::MAX_SPAWN
            )));
        }
        for id in &r.ids {
            validate::name("ids", id)?;
        }
        let snapshot = vms::snapshot_dir(&r.tag).map_err(internal)?;
        if !snapshot.exists() {
            return Err(Status::not_found(format!(
                "snapshot {} is not on executor {}",
                r.tag, self.state.id
            )));
        }
        let snap = snapshot.clone();
        tokio::task::spawn_blocking(move || tine_vmm::snapshot::file::load_header(&snap))
            .await
            .map_err(internal)?
            .map_err(|e| Status::failed_precondition(format!("snapshot {}: {e}", r.tag)))?;
        let timeout = Duration::from_millis(if r.ready_timeout_ms == 0 {
            120_000
        } else {
            r.ready_timeout_ms as u64
        });
        let free = (self.state.max_sandboxes as usize).saturating_sub(self.state.live_ids().len());
        let (tx, rx) = mpsc::channel(r.ids.len() + 1);
        for (i, id) in r.ids.into_iter().enumerate() {
            let tx = tx.clone();
            if i >= free {
                let _ = tx
                    .send(Ok(xpb::SpawnEvent {
                        id,
                        result: Some(xpb::spawn_event::Result::Error(format!(
                            "executor {} is full ({} sandboxes)",
                            self.state.id, self.state.max_sandboxes
                        ))),
                    }))
                    .await;
                continue;
            }
            let st = self.state.clone();
            let (tag, snapshot) = (r.tag.clone(), snapshot.clone());
            tokio::task::spawn_blocking(move || {
                let result = match st.spawn_one(&tag, snapshot, &id, timeout) {
                    Ok(d) => xpb::spawn_event::Result::ReadyUs(d.as_micros() as u64),
                    Err(e) => xpb::spawn_event::Result::Error(e),
                };
                let _ = tx.blocking_send(Ok(xpb::SpawnEvent {
                    id,
                    result: Some(result),
                }));
            });
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn kill(
        &self,
        req: Request<xpb::KillRequest>,
    ) -> Result<Response<xpb::KillResponse>, Status> {
        let id = req.into_inner().id;
        validate::name("id", &id)?;
        let st = self.state.clone();
        let existed = tokio::task::spawn_blocking(move || st.kill(&id))
            .await
            .map_err(internal)?;
        Ok(Response::new(xpb::KillResponse { existed }))
    }

    async fn exec(
        &self,
        req: Request<pb::ExecRequest>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let r = req.into_inner();
        let dir = self.state.sandbox_dir(&r.sandbox_id)?;
        if r.argv.is_empty() {
            return Err(Status::invalid_argument("argv: empty"));
        }
        let opts = ExecOptions {
            env: r.env.into_iter().collect(),
            cwd: (!r.cwd.is_empty()).then_some(r.cwd),
            stdin: r.stdin,
            timeout: (r.timeout_ms != 0).then(|| Duration::from_millis(r.timeout_ms as u64)),
        };
        let (tx, rx) = mpsc::channel(64);
        tokio::task::spawn_blocking(move || {
            let client = agent(&dir.join("vsock.sock"));
            let out = |ev: pb::exec_event::Event| {
                let _ = tx.blocking_send(Ok(pb::ExecEvent { event: Some(ev) }));
            };
            let res = client.exec(
                &r.argv,
                &opts,
                |d| out(pb::exec_event::Event::Stdout(d.to_vec())),
                |d| out(pb::exec_event::Event::Stderr(d.to_vec())),
            );
            match res {
                Ok(st) => {
                    let how = match (st.code, st.signal) {
                        (Some(c), _) => Some(pb::exit_status::How::Code(c)),
                        (None, Some(s)) => Some(pb::exit_status::How::Signal(s)),
                        (None, None) => None,
                    };
                    out(pb::exec_event::Event::Exit(pb::ExitStatus {
                        how,
                        timed_out: st.timed_out,
                    }));
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(agent_status(e)));
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn eval(
        &self,
        req: Request<pb::EvalRequest>,
    ) -> Result<Response<pb::EvalResponse>, Status> {
        let r = req.into_inner();
        let dir = self.state.sandbox_dir(&r.sandbox_id)?;
        let timeout = (r.timeout_ms != 0).then(|| Duration::from_millis(r.timeout_ms as u64));
        let out = tokio::task::spawn_blocking(move || {
            agent(&dir.join("vsock.sock")).eval_with_timeout(&r.code, timeout)
        })
        .await
        .map_err(internal)?
        .map_err(agent_status)?;
        Ok(Response::new(pb::EvalResponse {
            value: out.value,
            stdout: out.stdout,
            stderr: out.stderr,
            error: out.error,
            restarted: out.restarted,
        }))
    }

    async fn read_file(
        &self,
        req: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let r = req.into_inner();
        let dir = self.state.sandbox_dir(&r.sandbox_id)?;
        let (tx, rx) = mpsc::channel(4);
        tokio::task::spawn_blocking(move || {
            let mut w = ChunkWriter {
                tx: tx.clone(),
                buf: Vec::new(),
            };
            match agent(&dir.join("vsock.sock")).read_file(&r.path, &mut w) {
                Ok(info) => {
                    let data = std::mem::take(&mut w.buf);
                    let _ = w.send(pb::FileChunk {
                        data,
                        mode: info.mode,
                        size: info.size,
                    });
                }
                Err(e) => {
                    let _ = tx.blocking_send(Err(agent_status(e)));
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn write_file(
        &self,
        req: Request<Streaming<pb::WriteFileRequest>>,
    ) -> Result<Response<pb::WriteFileResponse>, Status> {
        let mut incoming = req.into_inner();
        let header = match incoming.message().await? {
            Some(pb::WriteFileRequest {
                part: Some(pb::write_file_request::Part::Header(h)),
            }) => h,
            _ => {
                return Err(Status::invalid_argument(
                    "the first WriteFile message must be the header",
                ))
            }
        };
        let dir = self.state.sandbox_dir(&header.sandbox_id)?;
        let (tx, rx) = std::sync::mpsc::sync_channel::<Result<Vec<u8>, String>>(4);
        let upload = tokio::task::spawn_blocking(move || {
            let reader = ChannelReader {
                rx,
                buf: Vec::new(),
                pos: 0,
            };
            agent(&dir.join("vsock.sock")).write_file(&header.path, header.mode, reader)
        });
        loop {
            let item = match incoming.message().await {
                Ok(Some(pb::WriteFileRequest {
                    part: Some(pb::write_file_request::Part::Data(d)),
                })) => Ok(d),
                Ok(None) => break,
                Ok(Some(_)) => Err("only data may follow the WriteFile header".to_string()),
                Err(e) => Err(format!("upload stream broke: {}", e.message())),
            };
            let failed = item.is_err();
            let tx2 = tx.clone();
            // Blocking send (bounded channel) off the async threads.
            let sent = tokio::task::spawn_blocking(move || tx2.send(item).is_ok())
                .await
                .unwrap_or(false);
            if failed || !sent {
                break;
            }
        }
        drop(tx);
        let size = upload.await.map_err(internal)?.map_err(agent_status)?;
        Ok(Response::new(pb::WriteFileResponse { size }))
    }
}
