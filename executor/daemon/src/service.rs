//! The executor API (tine.executor.v1) over this host's [`Host`]: snapshots under the data
//! directory, children restored by pre-started worker processes, agent calls relayed. Host
//! errors become gRPC codes here, and per-child failures travel with their code.

use std::io::Read;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tine_agent::client::{AgentErrorCode, ClientError, ExecOptions};
use tine_host::network::Policy;
use tine_host::{
    BranchKind, ErrorKind, Host, HostError, LayerInfo, ParentSpec, Resources, SpawnOptions,
};
use tine_proto::executor::v1 as xpb;
use tine_proto::executor::v1::executor_server::Executor;
use tine_proto::v1 as pb;
use tine_rpc::limits::MAX_SPAWN;
use tine_rpc::status::child_error;
use tine_rpc::{validate, ExecutorId, SandboxId, Tag};
use tine_snapshot_store::Digest;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::agent_calls::{relayed, AgentCalls};
use crate::metrics::ExecutorMetrics;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

const CHUNK: usize = 1 << 20;

pub struct State {
    pub id: ExecutorId,
    pub host: Host,
    /// Refuse VM work on a PVM /dev/kvm (Linux guests cannot run there).
    pub vm_refusal: Option<String>,
    pub metrics: ExecutorMetrics,
    /// Children that ended on their own, newest last, with when: reported with every
    /// heartbeat until they age out, so the control plane learns why even past a missed one.
    ended: std::sync::Mutex<std::collections::VecDeque<(std::time::Instant, pb::EndedSandbox)>>,
    /// Calls to children's guest agents in flight.
    agent_calls: AgentCalls,
}

/// How long an ended child is reported, and at most how many are.
const ENDED_KEPT: Duration = Duration::from_secs(600);
const ENDED_MAX: usize = 1024;

fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

/// The gRPC status for a host error: its kind picks the code, its message is kept.
pub fn host_status(e: &HostError) -> Status {
    let m = e.to_string();
    match e.kind() {
        ErrorKind::NotFound => Status::not_found(m),
        ErrorKind::AlreadyExists => Status::already_exists(m),
        ErrorKind::Exhausted => Status::resource_exhausted(m),
        ErrorKind::Precondition => Status::failed_precondition(m),
        ErrorKind::Deadline => Status::deadline_exceeded(m),
        ErrorKind::Denied => Status::permission_denied(m),
        ErrorKind::Unavailable => Status::unavailable(m),
        ErrorKind::Cancelled => Status::cancelled(m),
        ErrorKind::Invalid => Status::invalid_argument(m),
        ErrorKind::Internal => {
            tracing::error!("{m}");
            Status::internal(m)
        }
    }
}

/// A snapshot's layers as the API reports them.
fn kind_of(mode: pb::BranchMode) -> BranchKind {
    match mode {
        pb::BranchMode::Full => BranchKind::Full,
        pb::BranchMode::Live => BranchKind::Live,
        _ => BranchKind::Diff,
    }
}

pub fn layers_msg(l: &LayerInfo) -> pb::SnapshotLayers {
    pb::SnapshotLayers {
        head_digest: l.head.to_string(),
        parent_digest: l.parent.map(|d| d.to_string()).unwrap_or_default(),
        chain: l.chain.iter().map(|d| d.to_string()).collect(),
        memory_bytes: l.memory_bytes,
        stored_bytes: l.raw_bytes,
        compressed_bytes: l.stored_bytes,
    }
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
        ClientError::Cancelled => Status::cancelled("guest agent: the call was cancelled"),
        e @ (ClientError::NoAnswer(_)
        | ClientError::StalledFrame(..)
        | ClientError::StoppedReading(_)) => Status::deadline_exceeded(format!("guest agent: {e}")),
        other => Status::unavailable(format!("guest agent: {other}")),
    }
}

impl State {
    pub fn new(id: ExecutorId, host: Host, vm_refusal: Option<String>) -> Arc<State> {
        Arc::new(State {
            id,
            host,
            vm_refusal,
            metrics: ExecutorMetrics::new(),
            ended: Default::default(),
            agent_calls: AgentCalls::default(),
        })
    }

    fn ended(&self) -> Vec<pb::EndedSandbox> {
        let mut e = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        while e.front().is_some_and(|(t, _)| t.elapsed() > ENDED_KEPT) {
            e.pop_front();
        }
        e.iter().map(|(_, x)| x.clone()).collect()
    }

    pub fn report(&self) -> pb::ExecutorReport {
        let (total, avail) = meminfo();
        let live: Vec<String> = self
            .host
            .live_ids()
            .into_iter()
            .map(|i| i.into_string())
            .collect();
        self.metrics.vms_running.set(live.len() as i64);
        self.metrics.pool_idle.set(self.host.idle_workers() as i64);
        self.metrics.pool_target.set(self.host.pool_target() as i64);
        pb::ExecutorReport {
            capacity: Some(pb::Capacity {
                max_sandboxes: self.host.config().limits.max_vms,
                running_sandboxes: live.len() as u32,
                mem_total_mib: total,
                mem_available_mib: avail,
            }),
            cached_tags: self
                .host
                .snapshot_tags()
                .into_iter()
                .map(|t| t.into_string())
                .collect(),
            live_sandboxes: live,
            ended: self.ended(),
        }
    }

    fn sandbox_dir(&self, id: &str) -> Result<std::path::PathBuf, Status> {
        let id = validate::sandbox_id("sandbox_id", id)?;
        self.host.vm_dir(&id).map_err(|_| {
            Status::not_found(format!("sandbox {id} does not run on executor {}", self.id))
        })
    }

    fn refuse_vm_work(&self) -> Result<(), Status> {
        match &self.vm_refusal {
            Some(why) => Err(Status::failed_precondition(why.clone())),
            None => Ok(()),
        }
    }

    /// A spawn's network request as a policy over this executor's default.
    fn policy(&self, n: validate::NetworkRequest) -> Result<Policy, Status> {
        let net = self.host.network().ok_or_else(|| {
            Status::failed_precondition(
                "network: this executor runs without child networks (started with --no-network)",
            )
        })?;
        Ok(Policy {
            internet: n.internet.unwrap_or(net.config().default_policy.internet),
            allow: n.allow,
            deny: n.deny,
        })
    }

    /// Reap children whose VMM exited, count them, and refresh the gauges.
    pub fn reap(&self) {
        let gone = self.host.reap();
        self.metrics.vm_exits.inc_by(gone.len() as u64);
        let oom = gone.iter().filter(|g| g.out_of_memory).count();
        self.metrics.oom_kills.inc_by(oom as u64);
        let mut ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        for g in gone {
            if ended.len() == ENDED_MAX {
                ended.pop_front();
            }
            ended.push_back((
                std::time::Instant::now(),
                pb::EndedSandbox {
                    id: g.id.into_string(),
                    reason: g.reason,
                    out_of_memory: g.out_of_memory,
                },
            ));
        }
        drop(ended);
        self.metrics
            .vms_running
            .set(self.host.live_ids().len() as i64);
        self.metrics.pool_idle.set(self.host.idle_workers() as i64);
        self.metrics.pool_target.set(self.host.pool_target() as i64);
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

impl ExecutorService {
    fn branch_args(
        &self,
        r: &pb::BranchRequest,
    ) -> Result<(SandboxId, Tag, pb::BranchMode), Status> {
        self.state.refuse_vm_work()?;
        Ok((
            validate::sandbox_id("sandbox_id", &r.sandbox_id)?,
            validate::tag("tag", &r.tag)?,
            validate::branch_mode(r.mode)?,
        ))
    }

    /// The snapshot a branch made, as the control plane records it.
    fn branch_msg(
        &self,
        r: pb::BranchRequest,
        mode: pb::BranchMode,
        b: &tine_host::Branch,
    ) -> pb::Snapshot {
        pb::Snapshot {
            tag: r.tag,
            parent_tag: b.parent.to_string(),
            // The control plane knows the image (the parent's).
            image: String::new(),
            vcpus: b.header.vcpus,
            mem_mib: b.header.mem_size >> 20,
            created_unix_ms: tine_host::records::now_ms() as i64,
            executors: vec![self.state.id.to_string()],
            source_sandbox: r.sandbox_id,
            layers: b.layer.as_ref().map(layers_msg),
            branch: Some(pb::BranchInfo {
                mode: mode as i32,
                pause_us: b.paused.as_micros() as u64,
                pages_written: b.pages_written,
                took_us: b.took.as_micros() as u64,
                rebase_pause_us: b.rebase.map_or(0, |r| r.paused.as_micros() as u64),
            }),
            state: pb::SnapshotState::Ready as i32,
            error: String::new(),
        }
    }
}

/// Feeds a blocking `Read` (the agent upload) from the gRPC stream; an error in the
/// stream becomes a read error, so a broken upload is never committed.
/// The upload's data for the agent client, from the gRPC stream. An empty chunk marks the
/// end: a channel that closes without it (the caller went away) is an error, never a
/// shorter file.
struct ChannelReader {
    rx: mpsc::Receiver<Result<Vec<u8>, String>>,
    buf: Vec<u8>,
    pos: usize,
    done: bool,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        while self.pos == self.buf.len() {
            if self.done {
                return Ok(0);
            }
            match self.rx.blocking_recv() {
                Some(Ok(b)) if b.is_empty() => self.done = true,
                Some(Ok(b)) => {
                    self.buf = b;
                    self.pos = 0;
                }
                Some(Err(e)) => return Err(std::io::Error::other(e)),
                None => return Err(std::io::Error::other("the upload stopped before its end")),
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
        let tag = validate::tag("tag", &r.tag)?;
        validate::name("image", &r.image)?;
        // Checked here too: this host's memory is what a parent's RAM comes out of.
        validate::parent_shape(&r)?;
        let (total_mib, _) = meminfo();
        if total_mib != 0 && r.mem_mib > total_mib {
            return Err(Status::invalid_argument(format!(
                "mem_mib: {} is more than this host's {total_mib} MiB",
                r.mem_mib
            )));
        }
        let vcpus = u8::try_from(r.vcpus.max(1))
            .map_err(|_| Status::invalid_argument("vcpus: at most 255"))?;
        let spec = ParentSpec {
            // Only what the image store holds: a remote caller never names a host path.
            image: tine_host::ImageRef::Stored(r.image.clone()),
            tag,
            vcpus,
            mem_mib: (r.mem_mib != 0).then_some(r.mem_mib),
            evals: r.warmup_eval.clone(),
            ready_timeout: None,
            replace: false,
        };
        let st = self.state.clone();
        let made = tokio::task::spawn_blocking(move || st.host.create_snapshot(&spec))
            .await
            .map_err(internal)?
            .map_err(|e| host_status(&e))?;
        Ok(Response::new(pb::Snapshot {
            tag: r.tag,
            parent_tag: String::new(),
            image: r.image,
            vcpus: made.header.vcpus as u32,
            mem_mib: made.header.mem_size >> 20,
            created_unix_ms: tine_host::records::now_ms() as i64,
            executors: vec![self.state.id.to_string()],
            source_sandbox: String::new(),
            layers: made.layer.as_ref().map(layers_msg),
            branch: None,
            state: pb::SnapshotState::Ready as i32,
            error: String::new(),
        }))
    }

    async fn branch(
        &self,
        req: Request<pb::BranchRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let r = req.into_inner();
        if r.no_wait {
            return Err(Status::invalid_argument(
                "no_wait: this call answers once the snapshot is complete; StartBranch reports the resume",
            ));
        }
        let (id, tag, mode) = self.branch_args(&r)?;
        let st = self.state.clone();
        let b = tokio::task::spawn_blocking(move || st.host.branch(&id, &tag, kind_of(mode)))
            .await
            .map_err(internal)?
            .map_err(|e| host_status(&e))?;
        Ok(Response::new(self.branch_msg(r, mode, &b)))
    }

    type StartBranchStream = ReceiverStream<Result<xpb::BranchEvent, Status>>;

    async fn start_branch(
        &self,
        req: Request<pb::BranchRequest>,
    ) -> Result<Response<Self::StartBranchStream>, Status> {
        let r = req.into_inner();
        let (id, tag, mode) = self.branch_args(&r)?;
        let (tx, rx) = mpsc::channel(2);
        let svc = self.clone();
        tokio::task::spawn_blocking(move || {
            let resumed_tx = tx.clone();
            let made = svc
                .state
                .host
                .branch_then(&id, &tag, kind_of(mode), move |r| {
                    let ev = xpb::branch_event::Event::Resumed(xpb::BranchResumed {
                        pause_us: r.paused.as_micros() as u64,
                        parent_tag: r.parent.to_string(),
                    });
                    let _ = resumed_tx.blocking_send(Ok(xpb::BranchEvent { event: Some(ev) }));
                });
            // The branch runs to its end even if the caller went away: it is kept either way.
            let last = match made {
                Ok(b) => Ok(xpb::BranchEvent {
                    event: Some(xpb::branch_event::Event::Done(svc.branch_msg(r, mode, &b))),
                }),
                Err(e) => Err(host_status(&e)),
            };
            let _ = tx.blocking_send(last);
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delete_snapshot(
        &self,
        req: Request<xpb::DeleteSnapshotRequest>,
    ) -> Result<Response<xpb::DeleteSnapshotResponse>, Status> {
        let tag = validate::tag("tag", &req.into_inner().tag)?;
        let st = self.state.clone();
        let existed = tokio::task::spawn_blocking(move || st.host.delete_snapshot(&tag))
            .await
            .map_err(internal)?
            .map_err(|e| host_status(&e))?;
        Ok(Response::new(xpb::DeleteSnapshotResponse { existed }))
    }

    async fn spawn(
        &self,
        req: Request<xpb::SpawnRequest>,
    ) -> Result<Response<Self::SpawnStream>, Status> {
        self.state.refuse_vm_work()?;
        let r = req.into_inner();
        let tag = validate::tag("tag", &r.tag)?;
        if r.ids.is_empty() || r.ids.len() > MAX_SPAWN as usize {
            return Err(Status::invalid_argument(format!(
                "ids: give 1..={MAX_SPAWN} sandbox ids"
            )));
        }
        let ids = r
            .ids
            .iter()
            .map(|id| validate::sandbox_id("ids", id))
            .collect::<Result<Vec<SandboxId>, Status>>()?;
        validate::ready_timeout_ms(r.ready_timeout_ms)?;
        let layer = if r.head_digest.is_empty() {
            None
        } else {
            Some(
                Digest::parse(&r.head_digest)
                    .map_err(|e| Status::invalid_argument(format!("head_digest: {e}")))?,
            )
        };
        let network = match &r.network {
            Some(n) => Some(self.state.policy(validate::network(n)?)?),
            None => None,
        };
        let resources = r.resources.unwrap_or_default();
        let opts = SpawnOptions {
            ready_timeout: (r.ready_timeout_ms != 0)
                .then(|| Duration::from_millis(r.ready_timeout_ms as u64)),
            layer,
            network,
            resources: Resources {
                memory_limit_mib: resources.memory_limit_mib,
                cpu_millis: resources.cpu_millis,
            },
            ..SpawnOptions::default()
        };
        // A missing, unfetchable or broken snapshot, or limits this host cannot give, fail
        // the call, not each child; a host without the snapshot fetches it here (or, lazily,
        // what the first child needs), once.
        let (st, t, o) = (self.state.clone(), tag.clone(), opts.clone());
        tokio::task::spawn_blocking(move || st.host.prepare_spawn(&t, &o))
            .await
            .map_err(internal)?
            .map_err(|e| host_status(&e))?;
        let (tx, rx) = mpsc::channel(ids.len() + 1);
        let st = self.state.clone();
        let span = tracing::Span::current();
        tokio::task::spawn_blocking(move || {
            let _in = span.enter();
            let sent = st.host.spawn(&tag, ids.clone(), &opts, |o| {
                let result = match &o.result {
                    Ok(phases) => {
                        st.metrics.observe(phases);
                        xpb::spawn_event::Result::ReadyUs(phases.total.as_micros() as u64)
                    }
                    Err(e) => {
                        st.metrics
                            .spawn_failures
                            .with_label_values(&[e.reason()])
                            .inc();
                        xpb::spawn_event::Result::Failure(child_error(&host_status(e)))
                    }
                };
                let _ = tx.blocking_send(Ok(xpb::SpawnEvent {
                    id: o.id.into_string(),
                    result: Some(result),
                }));
            });
            if let Err(e) = sent {
                let _ = tx.blocking_send(Err(host_status(&e)));
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn kill(
        &self,
        req: Request<xpb::KillRequest>,
    ) -> Result<Response<xpb::KillResponse>, Status> {
        let id = validate::sandbox_id("id", &req.into_inner().id)?;
        let st = self.state.clone();
        let existed = tokio::task::spawn_blocking(move || st.host.kill(&id))
            .await
            .map_err(internal)?
            .map_err(|e| host_status(&e))?;
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
        // At most 16 chunks of 256 KiB wait for a slow caller; then the guest is not read.
        let (tx, rx) = mpsc::channel(16);
        let started = self
            .state
            .agent_calls
            .start(&r.sandbox_id, &dir, move |client| {
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
            })?;
        Ok(Response::new(relayed(rx, started)))
    }

    async fn eval(
        &self,
        req: Request<pb::EvalRequest>,
    ) -> Result<Response<pb::EvalResponse>, Status> {
        let r = req.into_inner();
        let dir = self.state.sandbox_dir(&r.sandbox_id)?;
        let timeout = (r.timeout_ms != 0).then(|| Duration::from_millis(r.timeout_ms as u64));
        let code = r.code;
        let started = self
            .state
            .agent_calls
            .start(&r.sandbox_id, &dir, move |c| {
                c.eval_with_timeout(&code, timeout)
            })?;
        // Dropped with this future if the caller goes away: that cancels the call.
        let _cancel = started.cancel;
        let out = started
            .result
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

    async fn expose_port(
        &self,
        req: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::ExposePortResponse>, Status> {
        self.state.refuse_vm_work()?;
        let r = req.into_inner();
        let id = validate::sandbox_id("sandbox_id", &r.sandbox_id)?;
        let port = validate::guest_port(r.guest_port)?;
        let st = self.state.clone();
        let addr = tokio::task::spawn_blocking(move || st.host.expose_port(&id, port))
            .await
            .map_err(internal)?
            .map_err(|e| host_status(&e))?;
        Ok(Response::new(pb::ExposePortResponse {
            address: addr.to_string(),
        }))
    }

    async fn usage(
        &self,
        req: Request<xpb::UsageRequest>,
    ) -> Result<Response<pb::SandboxUsage>, Status> {
        let id = validate::sandbox_id("id", &req.into_inner().id)?;
        let u = self.state.host.usage(&id).map_err(|e| host_status(&e))?;
        let u = u.ok_or_else(|| {
            Status::failed_precondition(format!(
                "sandbox {id} has no cgroup: {}",
                self.state.host.cgroups_refused()
            ))
        })?;
        Ok(Response::new(pb::SandboxUsage {
            memory_current_bytes: u.memory_current,
            memory_peak_bytes: u.memory_peak,
            memory_max_bytes: u.memory_max.unwrap_or(0),
            cpu_usage_us: u.cpu_usage.as_micros() as u64,
            cpu_throttled_periods: u.cpu_throttled,
        }))
    }

    async fn read_file(
        &self,
        req: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let r = req.into_inner();
        let dir = self.state.sandbox_dir(&r.sandbox_id)?;
        let (tx, rx) = mpsc::channel(4);
        let path = r.path;
        let started = self
            .state
            .agent_calls
            .start(&r.sandbox_id, &dir, move |client| {
                let mut w = ChunkWriter {
                    tx: tx.clone(),
                    buf: Vec::new(),
                };
                match client.read_file(&path, &mut w) {
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
            })?;
        Ok(Response::new(relayed(rx, started)))
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
        let (tx, rx) = mpsc::channel::<Result<Vec<u8>, String>>(4);
        let (path, mode) = (header.path, header.mode);
        let started = self
            .state
            .agent_calls
            .start(&header.sandbox_id, &dir, move |client| {
                let reader = ChannelReader {
                    rx,
                    buf: Vec::new(),
                    pos: 0,
                    done: false,
                };
                client.write_file(&path, mode, reader)
            })?;
        // Dropped with this future if the caller goes away: that cancels the call.
        let _cancel = started.cancel;
        loop {
            let item = match incoming.message().await {
                Ok(Some(pb::WriteFileRequest {
                    part: Some(pb::write_file_request::Part::Data(d)),
                })) if d.is_empty() => continue,
                Ok(Some(pb::WriteFileRequest {
                    part: Some(pb::write_file_request::Part::Data(d)),
                })) => Ok(d),
                // The end marker.
                Ok(None) => Ok(Vec::new()),
                Ok(Some(_)) => Err("only data may follow the WriteFile header".to_string()),
                Err(e) => Err(format!("upload stream broke: {}", e.message())),
            };
            let last = !matches!(&item, Ok(d) if !d.is_empty());
            // Bounded: a guest that stops reading holds at most four chunks here.
            if tx.send(item).await.is_err() || last {
                break;
            }
        }
        drop(tx);
        let size = started
            .result
            .await
            .map_err(internal)?
            .map_err(agent_status)?;
        Ok(Response::new(pb::WriteFileResponse { size }))
    }
}
