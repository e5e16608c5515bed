//! The public services: Snapshots, Sandboxes, Executors.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use serde_json::json;
use tine_proto::executor::v1 as xpb;
use tine_proto::v1 as pb;
use tine_proto::v1::sandboxes_server::Sandboxes;
use tine_proto::v1::snapshots_server::Snapshots;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::Instrument;

use crate::calls::{Ctx, Rpc};
use crate::db::{
    DbError, ExecutorReport, ExecutorRow, NewSnapshot, NewState, SandboxAt, SandboxRow,
    SandboxState, SnapshotLayers, SnapshotRow, SnapshotStatus,
};
use crate::executors::ExecClient;
use crate::metrics::{SpawnPhase, SpawnTimer};
use crate::now_ms;
use crate::paging::{self, Cursor};
use crate::scheduler::{self, Candidate, Policy};
use tine_rpc::status::{code_name, from_child_error};
use tine_rpc::validate;

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Snapshot creation boots and warms a guest: minutes in the nested lab.
const CREATE_SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(1800);
/// A branch pauses a sandbox and writes its pages (a complete image for FULL).
const BRANCH_TIMEOUT: Duration = Duration::from_secs(600);

impl From<DbError> for Status {
    fn from(e: DbError) -> Status {
        match &e {
            DbError::NoSnapshot(_) => Status::not_found(e.to_string()),
            DbError::SnapshotExists(_) => Status::already_exists(e.to_string()),
            DbError::HasDescendants { .. } | DbError::StillWriting(_) | DbError::NotWriting(_) => {
                Status::failed_precondition(e.to_string())
            }
            DbError::ExecutorClaimed { .. } => Status::permission_denied(e.to_string()),
            DbError::Sql(_) | DbError::Inline(_) | DbError::Migrate(_) | DbError::Create(_) => {
                tracing::error!("{e}");
                Status::internal(e.to_string())
            }
        }
    }
}

/// An executor's report of a snapshot's layers, checked: every digest must parse, since
/// executors fetch by them.
fn layers_from(l: &pb::SnapshotLayers) -> Result<SnapshotLayers, Status> {
    let digest = |field: &str, d: &str| {
        tine_snapshot_store::Digest::parse(d)
            .map(|d| d.to_string())
            .map_err(|e| Status::internal(format!("the executor reported a bad {field}: {e}")))
    };
    Ok(SnapshotLayers {
        head_digest: digest("head_digest", &l.head_digest)?,
        parent_digest: match l.parent_digest.as_str() {
            "" => None,
            p => Some(digest("parent_digest", p)?),
        },
        chain: l
            .chain
            .iter()
            .map(|d| digest("chain", d))
            .collect::<Result<_, _>>()?,
        memory_bytes: l.memory_bytes,
        stored_bytes: l.stored_bytes,
        compressed_bytes: l.compressed_bytes,
    })
}

fn snapshot_msg(r: &SnapshotRow) -> pb::Snapshot {
    let (state, error) = match r.status(now_ms()) {
        SnapshotStatus::Ready => (pb::SnapshotState::Ready, String::new()),
        SnapshotStatus::Writing { .. } => (pb::SnapshotState::Writing, String::new()),
        SnapshotStatus::Failed(why) => (pb::SnapshotState::Failed, why),
    };
    pb::Snapshot {
        tag: r.tag.clone(),
        parent_tag: r.parent_tag.clone().unwrap_or_default(),
        image: r.image.clone(),
        vcpus: r.vcpus as u32,
        mem_mib: r.mem_mib as u64,
        created_unix_ms: r.created_ms,
        executors: r.executor_list(),
        source_sandbox: r.source_sandbox.clone().unwrap_or_default(),
        layers: r.layers().map(|l| pb::SnapshotLayers {
            head_digest: l.head_digest,
            parent_digest: l.parent_digest.unwrap_or_default(),
            chain: l.chain,
            memory_bytes: l.memory_bytes,
            stored_bytes: l.stored_bytes,
            compressed_bytes: l.compressed_bytes,
        }),
        branch: None,
        state: state as i32,
        error,
    }
}

/// The next event of an executor's branch stream; its end before the snapshot is an error.
async fn next_branch_event(
    events: &mut Streaming<xpb::BranchEvent>,
) -> Result<xpb::branch_event::Event, Status> {
    match events.message().await? {
        Some(xpb::BranchEvent { event: Some(e) }) => Ok(e),
        Some(_) => Err(Status::internal("the executor sent an empty branch event")),
        None => Err(Status::internal(
            "the executor ended the branch without reporting the snapshot",
        )),
    }
}

/// The deadline a client set on its call (`grpc-timeout`), if any.
fn call_deadline<T>(req: &Request<T>) -> Option<Duration> {
    crate::hop::grpc_timeout(req.metadata().get("grpc-timeout")?.to_str().ok()?)
}

fn sandbox_msg(r: &SandboxRow) -> pb::Sandbox {
    let state = match r.state() {
        SandboxState::Starting => pb::SandboxState::Starting,
        SandboxState::Ready => pb::SandboxState::Ready,
        SandboxState::Failed => pb::SandboxState::Failed,
        SandboxState::Killed => pb::SandboxState::Killed,
        SandboxState::Lost => pb::SandboxState::Lost,
    };
    pb::Sandbox {
        id: r.id.clone(),
        tag: r.tag.clone(),
        executor: r.executor_id.clone(),
        state: state as i32,
        created_unix_ms: r.created_ms,
        ready_us: r.ready_us.unwrap_or(0) as u64,
        error: r.error.clone().unwrap_or_default(),
        resources: (r.memory_limit_mib != 0 || r.cpu_millis != 0).then_some(pb::Resources {
            memory_limit_mib: r.memory_limit_mib as u64,
            cpu_millis: r.cpu_millis as u32,
        }),
        usage: None,
        expires_unix_ms: r.expires_ms.unwrap_or(0),
    }
}

fn report_from(r: Option<pb::ExecutorReport>) -> ExecutorReport {
    let r = r.unwrap_or_default();
    let c = r.capacity.unwrap_or_default();
    ExecutorReport {
        max_sandboxes: c.max_sandboxes,
        running_sandboxes: c.running_sandboxes,
        mem_total_mib: c.mem_total_mib,
        mem_available_mib: c.mem_available_mib,
        cached_tags: r.cached_tags,
        live_sandboxes: r.live_sandboxes,
        ended: r
            .ended
            .into_iter()
            .map(|e| (e.id, e.reason, e.out_of_memory))
            .collect(),
    }
}

fn new_sandbox_id() -> String {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).expect("getrandom");
    format!("sbx-{}", hex::encode(b))
}

#[derive(Clone)]
pub struct Api {
    pub ctx: Arc<Ctx>,
}

impl Api {
    /// Executors heard from within three heartbeat periods.
    pub(crate) fn is_up(&self, e: &ExecutorRow) -> bool {
        now_ms() - e.last_heartbeat_ms <= 3_000 * self.ctx.heartbeat_interval_s as i64
    }

    fn executor_msg(&self, e: &ExecutorRow, tags: Vec<String>) -> pb::Executor {
        let state = if !self.is_up(e) {
            pb::ExecutorState::Down
        } else if e.draining {
            pb::ExecutorState::Draining
        } else {
            pb::ExecutorState::Up
        };
        pb::Executor {
            id: e.id.clone(),
            addr: e.addr.clone(),
            state: state as i32,
            capacity: Some(pb::Capacity {
                max_sandboxes: e.max_sandboxes as u32,
                running_sandboxes: e.running_sandboxes as u32,
                mem_total_mib: e.mem_total_mib as u64,
                mem_available_mib: e.mem_available_mib as u64,
            }),
            last_heartbeat_unix_ms: e.last_heartbeat_ms,
            cached_tags: tags,
        }
    }

    async fn executor_client(&self, id: &str) -> Result<(ExecutorRow, ExecClient), Status> {
        let e = self
            .ctx
            .db
            .executor(id)
            .await?
            .ok_or_else(|| Status::not_found(format!("executor {id} is not registered")))?;
        let c = self.ctx.executors.client(&e.id, &e.addr)?;
        Ok((e, c))
    }

    /// What a ready sandbox's cgroup counts, asked of its executor; None (logged) when the
    /// executor has no cgroups or does not answer in time: the rest of GetSandbox stands.
    async fn usage(&self, s: &SandboxRow) -> Option<pb::SandboxUsage> {
        let (_, mut c) = self.executor_client(&s.executor_id).await.ok()?;
        let call = c.usage(xpb::UsageRequest { id: s.id.clone() });
        match tokio::time::timeout(Duration::from_secs(2), call).await {
            Ok(Ok(u)) => Some(u.into_inner()),
            Ok(Err(e)) if e.code() == Code::FailedPrecondition => None,
            Ok(Err(e)) => {
                tracing::warn!(sandbox = %s.id, "usage: {}", e.message());
                None
            }
            Err(_) => {
                tracing::warn!(sandbox = %s.id, "usage: its executor did not answer in 2 s");
                None
            }
        }
    }

    /// Kill the live sandboxes whose timeout ran out: each through its executor (one that is
    /// gone there already counts as killed), then recorded KILLED with why, audited and
    /// counted. Executors are worked on side by side, so one that does not answer holds up
    /// only its own sandboxes, and only until its first such failure in this pass: the rest of
    /// its sandboxes are tried again on the next.
    pub async fn expire_due(&self) {
        let due = match self.ctx.db.expired(now_ms()).await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("listing expired sandboxes: {e}");
                return;
            }
        };
        let mut by_executor: std::collections::BTreeMap<String, Vec<SandboxAt>> =
            Default::default();
        for at in due {
            by_executor.entry(at.addr.clone()).or_default().push(at);
        }
        futures::future::join_all(by_executor.into_values().map(|due| self.expire_on(due))).await;
    }

    /// [`Self::expire_due`] for the due sandboxes of one executor.
    async fn expire_on(&self, due: Vec<SandboxAt>) {
        for at in due {
            let id = at.sandbox.id.clone();
            let killed = match self.ctx.executors.client(&at.sandbox.executor_id, &at.addr) {
                Ok(mut c) => {
                    let kill = c.kill(xpb::KillRequest { id: id.clone() });
                    match tokio::time::timeout(Duration::from_secs(5), kill).await {
                        Ok(Ok(r)) => Ok(r.into_inner().existed),
                        Ok(Err(e)) if e.code() == Code::NotFound => Ok(false),
                        Ok(Err(e)) if e.code() == Code::Unavailable => {
                            Err((e.message().into(), true))
                        }
                        Ok(Err(e)) => Err((e.message().to_string(), false)),
                        Err(_) => Err(("no answer in 5 s".to_string(), true)),
                    }
                }
                Err(e) => Err((e.message().to_string(), true)),
            };
            match killed {
                Ok(existed) => self.record_expiry(&at, existed).await,
                Err((why, executor_down)) => {
                    tracing::warn!(sandbox = %id, executor = %at.sandbox.executor_id, "killing an expired sandbox: {why}; trying again");
                    if executor_down {
                        return;
                    }
                }
            }
        }
    }

    /// `existed`: its executor had it and stopped it.
    async fn record_expiry(&self, at: &SandboxAt, existed: bool) {
        let id = &at.sandbox.id;
        let lived_s = (now_ms() - at.sandbox.created_ms).max(0) / 1000;
        let reason = format!("expired: its timeout ran out after {lived_s} s");
        match self.ctx.db.end_killed(id, Some(&reason), existed).await {
            Ok(Some(_)) => {
                tracing::info!(sandbox = %id, lived_s, "sandbox expired");
                self.ctx
                    .metrics
                    .sandboxes_ended
                    .with_label_values(&["expired"])
                    .inc();
                self.ctx.audit_event(
                    "SandboxExpired",
                    "control-plane",
                    json!({"id": id, "executor": at.sandbox.executor_id, "lived_s": lived_s}),
                );
            }
            Ok(None) => {} // ended meanwhile (killed, failed): nothing to add
            Err(e) => tracing::warn!(sandbox = %id, "recording an expiry: {e}"),
        }
    }

    /// Record the sandboxes an executor reports ended on their own: FAILED with the reason,
    /// each audited (once) and counted.
    async fn apply_ended(&self, executor: &str, report: &ExecutorReport) -> Result<(), Status> {
        // What an executor says is bounded here: at most 4096 entries, ids that are names,
        // reasons cut to 1 KiB; a bad entry is dropped, not the whole heartbeat.
        let ended: Vec<(String, String, bool)> = report
            .ended
            .iter()
            .take(4096)
            .filter(|(id, _, _)| validate::name("report.ended.id", id).is_ok())
            .map(|(id, reason, oom)| {
                let mut r = reason.clone();
                if r.len() > 1024 {
                    let mut cut = 1024;
                    while !r.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    r.truncate(cut);
                }
                (id.clone(), r, *oom)
            })
            .collect();
        let newly = self.ctx.db.end_reported(executor, &ended).await?;
        for (id, reason, oom) in newly {
            let cause = if oom { "out_of_memory" } else { "exited" };
            self.ctx
                .metrics
                .sandboxes_ended
                .with_label_values(&[cause])
                .inc();
            tracing::warn!(sandbox = %id, %executor, %reason, "sandbox ended");
            self.ctx.audit_event(
                "SandboxEnded",
                &format!("executor:{executor}"),
                json!({"id": id, "executor": executor, "reason": reason, "out_of_memory": oom}),
            );
        }
        Ok(())
    }

    /// The ready sandbox `id` and a client for its executor.
    async fn sandbox_client(&self, id: &str) -> Result<ExecClient, Status> {
        validate::name("sandbox_id", id)?;
        let at = self
            .ctx
            .db
            .sandbox_at(id)
            .await?
            .ok_or_else(|| Status::not_found(format!("sandbox {id} does not exist")))?;
        if at.sandbox.state() != SandboxState::Ready {
            return Err(Status::failed_precondition(format!(
                "sandbox {id} is {}, not ready",
                at.sandbox.state().as_str()
            )));
        }
        self.ctx.executors.client(&at.sandbox.executor_id, &at.addr)
    }

    // ---- Snapshots ----

    /// A snapshot just recorded, as the API shows it.
    async fn recorded(&self, tag: &str) -> Result<pb::Snapshot, Status> {
        let row = self
            .ctx
            .db
            .snapshot(tag)
            .await?
            .ok_or_else(|| Status::internal("snapshot vanished"))?;
        Ok(snapshot_msg(&row))
    }

    async fn create_snapshot_inner(
        &self,
        r: pb::CreateSnapshotRequest,
    ) -> Result<pb::Snapshot, Status> {
        validate::name("tag", &r.tag)?;
        validate::name("image", &r.image)?;
        validate::parent_shape(&r)?;
        self.free_tag(&r.tag).await?;
        let executor = if r.executor.is_empty() {
            self.ctx
                .db
                .executor_loads(&r.tag)
                .await?
                .into_iter()
                .filter(|l| self.is_up(&l.executor) && !l.executor.draining)
                .max_by_key(|l| l.executor.max_sandboxes - l.live)
                .ok_or_else(|| Status::unavailable("no executor is up to build the snapshot on"))?
                .executor
                .id
        } else {
            validate::name("executor", &r.executor)?;
            r.executor.clone()
        };
        let (e, mut client) = self.executor_client(&executor).await?;
        if !self.is_up(&e) {
            return Err(Status::unavailable(format!("executor {executor} is down")));
        }
        // Recorded as being written before the executor starts, so a stop of either side
        // leaves a failed record naming where the files may be, never a copy nobody knows of.
        let deadline = CREATE_SNAPSHOT_TIMEOUT + Duration::from_secs(30);
        self.ctx
            .db
            .insert_snapshot(&NewSnapshot {
                tag: r.tag.clone(),
                parent_tag: None,
                image: r.image.clone(),
                vcpus: r.vcpus,
                mem_mib: r.mem_mib,
                source_sandbox: None,
                executor_id: executor.clone(),
                layers: None,
                state: NewState::Writing {
                    until_ms: now_ms() + deadline.as_millis() as i64,
                },
            })
            .await?;
        // The executor's work and its record go on in a task of their own: a caller that
        // hangs up does not leave the record writing until its deadline.
        let db = self.ctx.db.clone();
        let (tag, reply_tag) = (r.tag.clone(), r.tag.clone());
        let ended = tokio::spawn(async move {
            let mut req = Request::new(r);
            req.set_timeout(CREATE_SNAPSHOT_TIMEOUT);
            let made = async {
                let made = client
                    .create_snapshot(req)
                    .await
                    .map_err(|e| executor_lost(&executor, e))?
                    .into_inner();
                let layers = made.layers.as_ref().map(layers_from).transpose()?;
                Ok::<_, Status>((made, layers))
            }
            .await;
            match made {
                Ok((made, layers)) => {
                    let shape = Some((made.vcpus, made.mem_mib));
                    db.finish_snapshot(&tag, &executor, layers.as_ref(), shape)
                        .await
                        .map_err(Status::from)
                }
                // The executor has a copy of that tag no record knows of, and made nothing:
                // leave the tag unrecorded, as it was (deleting that copy is not this call's).
                Err(e) if e.code() == Code::AlreadyExists => {
                    if let Err(d) = db.forget_writing(&tag).await {
                        tracing::warn!(%tag, "could not forget a refused snapshot: {d}");
                    }
                    Err(e)
                }
                Err(e) => {
                    let why = format!("{}: {}", code_name(e.code()), e.message());
                    if let Err(d) = db.fail_snapshot(&tag, &why).await {
                        tracing::warn!(%tag, "could not record a failed snapshot: {d}");
                    }
                    Err(e)
                }
            }
        })
        .await;
        ended.map_err(|e| {
            Status::internal(format!("the snapshot's task ended abnormally: {e}"))
        })??;
        self.recorded(&reply_tag).await
    }

    /// Make `tag` free for a new snapshot: ALREADY_EXISTS if a snapshot has it, unless that
    /// one failed, in which case it is replaced (what it left on its executor goes first).
    async fn free_tag(&self, tag: &str) -> Result<(), Status> {
        match self.ctx.db.snapshot(tag).await? {
            None => Ok(()),
            Some(row) => match row.status(now_ms()) {
                SnapshotStatus::Failed(_) => self.forget_failed(&row).await,
                _ => Err(Status::already_exists(format!(
                    "snapshot {tag} already exists"
                ))),
            },
        }
    }

    /// Remove a failed snapshot's record and whatever its attempt left on the executor it was
    /// written on, so its tag can be created again. An executor that cannot be asked keeps the
    /// record, and the call says why.
    async fn forget_failed(&self, row: &SnapshotRow) -> Result<(), Status> {
        for ex in row.holders() {
            let ex = ex.as_str();
            let mut c = match self.executor_client(ex).await {
                Ok((_, c)) => c,
                // An executor that left the cluster holds nothing of it any more.
                Err(e) if e.code() == Code::NotFound => continue,
                Err(e) => return Err(e),
            };
            let req = xpb::DeleteSnapshotRequest {
                tag: row.tag.clone(),
            };
            c.delete_snapshot(req).await.map_err(|e| {
                Status::unavailable(format!(
                    "snapshot {} failed on executor {ex}, which cannot remove what it left now \
                     ({}: {}); try again when it is up, or delete the snapshot",
                    row.tag,
                    code_name(e.code()),
                    e.message()
                ))
            })?;
        }
        match self.ctx.db.delete_snapshot(&row.tag, false).await {
            // A concurrent retry removed it first.
            Ok(_) | Err(DbError::NoSnapshot(_)) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    async fn delete_snapshot_inner(
        &self,
        r: pb::DeleteSnapshotRequest,
    ) -> Result<pb::DeleteSnapshotResponse, Status> {
        validate::name("tag", &r.tag)?;
        let deleted = self.ctx.db.delete_snapshot(&r.tag, r.cascade).await?;
        // The records are gone; now free the files. An executor that is unreachable keeps
        // its copy, which no longer matches any record (reported as unknown, never used).
        for s in &deleted {
            for ex in s.holders() {
                if let Ok((_, mut c)) = self.executor_client(&ex).await {
                    let req = xpb::DeleteSnapshotRequest { tag: s.tag.clone() };
                    if let Err(e) = c.delete_snapshot(req).await {
                        tracing::warn!(tag = %s.tag, executor = %ex, "could not delete the copy: {e}");
                    }
                }
            }
        }
        Ok(pb::DeleteSnapshotResponse {
            deleted: deleted.into_iter().map(|s| s.tag).collect(),
        })
    }

    /// Snapshot a ready sandbox on its executor as a child of the snapshot it was forked from.
    async fn branch_inner(&self, r: pb::BranchRequest) -> Result<pb::Snapshot, Status> {
        validate::name("sandbox_id", &r.sandbox_id)?;
        validate::name("tag", &r.tag)?;
        let mode = validate::branch_mode(r.mode)?;
        self.free_tag(&r.tag).await?;
        let at = self
            .ctx
            .db
            .sandbox_at(&r.sandbox_id)
            .await?
            .ok_or_else(|| Status::not_found(format!("sandbox {} does not exist", r.sandbox_id)))?;
        if at.sandbox.state() != SandboxState::Ready {
            return Err(Status::failed_precondition(format!(
                "sandbox {} is {}, not ready: only a ready sandbox can be branched",
                r.sandbox_id,
                at.sandbox.state().as_str()
            )));
        }
        // What a diff applies over is the executor's to say (the snapshot the sandbox was
        // forked from, or its latest branch still there); the image is the lineage's.
        let forked_from = self.ctx.db.snapshot(&at.sandbox.tag).await?;
        let mut client = self
            .ctx
            .executors
            .client(&at.sandbox.executor_id, &at.addr)?;
        let mut req = Request::new(r.clone());
        req.set_timeout(BRANCH_TIMEOUT);
        let mut events = client.start_branch(req).await?.into_inner();
        let db = &self.ctx.db;
        let new = |parent: Option<&SnapshotRow>| NewSnapshot {
            tag: r.tag.clone(),
            parent_tag: parent.map(|p| p.tag.clone()),
            image: parent
                .or(forked_from.as_ref())
                .map_or_else(|| "unknown".to_string(), |p| p.image.clone()),
            vcpus: 0,
            mem_mib: 0,
            source_sandbox: Some(r.sandbox_id.clone()),
            executor_id: at.sandbox.executor_id.clone(),
            layers: None,
            state: NewState::Ready,
        };
        let made = match next_branch_event(&mut events).await? {
            xpb::branch_event::Event::Done(made) => made,
            xpb::branch_event::Event::Resumed(resumed) if r.no_wait => {
                let parent = db.snapshot(&resumed.parent_tag).await?;
                // The sandbox runs again: record the snapshot as writing and let a task of
                // our own see the branch to its end (or failure).
                let deadline = BRANCH_TIMEOUT + Duration::from_secs(30);
                self.ctx
                    .db
                    .insert_snapshot(&NewSnapshot {
                        // Its size is the source's: that of the snapshot it was forked from.
                        vcpus: forked_from.as_ref().map_or(0, |p| p.vcpus as u32),
                        mem_mib: forked_from.as_ref().map_or(0, |p| p.mem_mib as u64),
                        state: NewState::Writing {
                            until_ms: now_ms() + deadline.as_millis() as i64,
                        },
                        ..new(parent.as_ref())
                    })
                    .await?;
                let db = self.ctx.db.clone();
                let (tag, executor) = (r.tag.clone(), at.sandbox.executor_id.clone());
                tokio::spawn(async move {
                    let end = tokio::time::timeout(deadline, next_branch_event(&mut events)).await;
                    let made = match end {
                        Ok(Ok(xpb::branch_event::Event::Done(made))) => {
                            made.layers.as_ref().map(layers_from).transpose()
                        }
                        Ok(Ok(xpb::branch_event::Event::Resumed(_))) => {
                            Err(Status::internal("the executor reported the resume twice"))
                        }
                        Ok(Err(e)) => Err(e),
                        Err(_) => Err(Status::deadline_exceeded(format!(
                            "the executor did not finish the branch within {deadline:?}"
                        ))),
                    };
                    let recorded = match made {
                        Ok(layers) => {
                            db.finish_snapshot(&tag, &executor, layers.as_ref(), None)
                                .await
                        }
                        Err(e) => {
                            let why = format!("{}: {}", code_name(e.code()), e.message());
                            tracing::warn!(%tag, "branch failed after its sandbox resumed: {why}");
                            db.fail_snapshot(&tag, &why).await
                        }
                    };
                    if let Err(e) = recorded {
                        tracing::warn!(%tag, "could not record the end of a branch: {e}");
                    }
                });
                return Ok(pb::Snapshot {
                    branch: Some(pb::BranchInfo {
                        mode: mode as i32,
                        pause_us: resumed.pause_us,
                        pages_written: 0,
                        took_us: 0,
                        rebase_pause_us: 0,
                    }),
                    ..self.recorded(&r.tag).await?
                });
            }
            xpb::branch_event::Event::Resumed(_) => match next_branch_event(&mut events).await? {
                xpb::branch_event::Event::Done(made) => made,
                xpb::branch_event::Event::Resumed(_) => {
                    return Err(Status::internal("the executor reported the resume twice"))
                }
            },
        };
        let layers = made.layers.as_ref().map(layers_from).transpose()?;
        let parent = db.snapshot(&made.parent_tag).await?;
        let inserted = db
            .insert_snapshot(&NewSnapshot {
                vcpus: made.vcpus,
                mem_mib: made.mem_mib,
                layers,
                ..new(parent.as_ref())
            })
            .await;
        if let Err(e) = inserted {
            // Not recorded, so not kept: the executor's copy would match no snapshot.
            let req = xpb::DeleteSnapshotRequest { tag: r.tag.clone() };
            if let Err(d) = client.delete_snapshot(req).await {
                tracing::warn!(tag = %r.tag, "could not delete an unrecorded branch: {d}");
            }
            return Err(e.into());
        }
        Ok(pb::Snapshot {
            branch: made.branch,
            ..self.recorded(&r.tag).await?
        })
    }

    // ---- Sandboxes ----

    /// Wait until snapshot `tag` can be spawned from: it exists and is READY. One still being
    /// written is waited for until `deadline` (the call's), or refused at once with `no_wait`.
    async fn await_snapshot(
        &self,
        tag: &str,
        no_wait: bool,
        deadline: Option<Duration>,
    ) -> Result<(), Status> {
        let t0 = std::time::Instant::now();
        // Give up a little before the caller does, to answer with the reason.
        let patience = deadline.map(|d| d.saturating_sub(d / 10));
        loop {
            let row = self
                .ctx
                .db
                .snapshot(tag)
                .await?
                .ok_or_else(|| Status::not_found(format!("snapshot {tag} does not exist")))?;
            match row.status(now_ms()) {
                SnapshotStatus::Ready => return Ok(()),
                SnapshotStatus::Failed(why) => {
                    return Err(Status::failed_precondition(format!(
                        "snapshot {tag} failed: {why}"
                    )))
                }
                SnapshotStatus::Writing { .. } if no_wait => {
                    return Err(Status::failed_precondition(format!(
                        "snapshot {tag} is still being written: spawn again once it is READY, or without no_wait to wait for it"
                    )))
                }
                SnapshotStatus::Writing { .. } => {
                    if patience.is_some_and(|p| t0.elapsed() >= p) {
                        return Err(Status::deadline_exceeded(format!(
                            "snapshot {tag} was still being written after {:?}",
                            t0.elapsed()
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    async fn start_spawn(
        &self,
        r: pb::SpawnRequest,
        deadline: Option<Duration>,
        started: Instant,
    ) -> Result<ReceiverStream<Result<pb::SpawnEvent, Status>>, Status> {
        validate::name("tag", &r.tag)?;
        validate::spawn_count(r.count)?;
        validate::ready_timeout_ms(r.ready_timeout_ms)?;
        if let Some(n) = &r.network {
            validate::network(n)?;
        }
        let resources = r.resources.unwrap_or_default();
        validate::resources(&resources)?;
        let lifetime = self.ctx.timeouts.for_spawn(r.sandbox_timeout_s)?;
        let placement = r.placement.clone().unwrap_or_default();
        for id in &placement.executors {
            validate::name("placement.executors", id)?;
        }
        let policy = match pb::PlacementPolicy::try_from(placement.policy) {
            Ok(pb::PlacementPolicy::Pack) => Policy::Pack,
            Ok(_) => Policy::Spread,
            Err(_) => return Err(Status::invalid_argument("placement.policy: unknown value")),
        };
        let mut placing = Instant::now();
        let mut loads = self.ctx.db.executor_loads(&r.tag).await?;
        // Held or in the store means it exists and is complete; only otherwise is a second
        // look needed (it may not exist, have failed, or still be written).
        if !loads.iter().any(|l| l.holds) && loads.first().is_none_or(|l| l.head_digest.is_none()) {
            self.await_snapshot(&r.tag, r.no_wait, deadline).await?;
            // `place` is the read and the placement, not the wait for a snapshot being written.
            placing = Instant::now();
            loads = self.ctx.db.executor_loads(&r.tag).await?;
        }
        let holders: Vec<String> = loads
            .iter()
            .filter(|l| l.holds)
            .map(|l| l.executor.id.clone())
            .collect();
        // In the store, any executor can fetch it: holding it is a preference, not a filter.
        let head_digest = loads.first().and_then(|l| l.head_digest.clone());
        let counts: HashMap<&str, i64> = loads
            .iter()
            .map(|l| (l.executor.id.as_str(), l.live))
            .collect();
        let all: Vec<ExecutorRow> = loads.iter().map(|l| l.executor.clone()).collect();
        for id in &placement.executors {
            if !all.iter().any(|e| &e.id == id) {
                return Err(Status::invalid_argument(format!(
                    "placement.executors: {id} is not registered"
                )));
            }
        }
        // Without layers in the store only the executors holding the snapshot can restore it.
        let usable: Vec<&ExecutorRow> = all
            .iter()
            .filter(|e| self.is_up(e) && !e.draining)
            .filter(|e| placement.executors.is_empty() || placement.executors.contains(&e.id))
            .filter(|e| head_digest.is_some() || holders.contains(&e.id))
            .collect();
        let candidates: Vec<Candidate> = usable
            .iter()
            .map(|e| Candidate {
                id: e.id.clone(),
                free: (e.max_sandboxes - counts.get(e.id.as_str()).copied().unwrap_or(0)).max(0)
                    as u32,
                has_snapshot: holders.contains(&e.id),
            })
            .collect();
        let plan = scheduler::place(r.count, &candidates, policy);
        let ids: Vec<String> = (0..r.count).map(|_| new_sandbox_id()).collect();
        let metrics = &self.ctx.metrics;
        metrics.spawn_phase(SpawnPhase::Place, placing.elapsed());
        let inserting = Instant::now();
        let rows: Vec<(String, String, String)> = plan
            .iter()
            .zip(&ids)
            .filter_map(|(p, id)| p.map(|i| (id.clone(), r.tag.clone(), candidates[i].id.clone())))
            .collect();
        self.ctx
            .db
            .insert_sandboxes(
                &rows,
                (resources.memory_limit_mib, resources.cpu_millis),
                lifetime,
            )
            .await?;
        metrics.spawn_phase(SpawnPhase::Insert, inserting.elapsed());

        let (tx, rx) = mpsc::channel(r.count as usize + 1);
        let placed = rows.len();
        for (index, (p, id)) in plan.iter().zip(&ids).enumerate() {
            if p.is_none() {
                let why = if candidates.is_empty() {
                    match head_digest {
                        Some(_) => "no executor is up and not draining".to_string(),
                        None => format!("no up, non-draining executor holds snapshot {}", r.tag),
                    }
                } else {
                    format!("no free slot: {} of {} children placed", placed, r.count)
                };
                let _ = tx
                    .send(Ok(failure_event(
                        index as u32,
                        id,
                        "",
                        Code::ResourceExhausted,
                        &why,
                    )))
                    .await;
            }
        }
        // One executor call per executor, all running at once.
        let mut groups: HashMap<usize, Vec<(u32, String)>> = HashMap::new();
        for (index, (p, id)) in plan.iter().zip(&ids).enumerate() {
            if let Some(i) = p {
                groups
                    .entry(*i)
                    .or_default()
                    .push((index as u32, id.clone()));
            }
        }
        let timeout = if r.ready_timeout_ms == 0 {
            tine_rpc::limits::DEFAULT_READY_TIMEOUT_MS
        } else {
            r.ready_timeout_ms
        };
        let total = SpawnTimer::start(self.ctx.metrics.clone(), started);
        for (i, children) in groups {
            let total = total.clone();
            let executor = usable[i].clone();
            let api = self.clone();
            let tx = tx.clone();
            let req = xpb::SpawnRequest {
                tag: r.tag.clone(),
                ids: children.iter().map(|(_, id)| id.clone()).collect(),
                resources: r.resources,
                ready_timeout_ms: timeout,
                head_digest: head_digest.clone().unwrap_or_default(),
                network: r.network.clone(),
            };
            // The executor call continues this request's trace.
            let span = tracing::Span::current();
            tokio::spawn(
                async move {
                    api.run_spawn_group(executor, req, children, tx).await;
                    drop(total);
                }
                .instrument(span),
            );
        }
        Ok(ReceiverStream::new(rx))
    }

    /// Ask one executor for its share of the children and relay each child's outcome.
    async fn run_spawn_group(
        &self,
        executor: ExecutorRow,
        req: xpb::SpawnRequest,
        children: Vec<(u32, String)>,
        tx: mpsc::Sender<Result<pb::SpawnEvent, Status>>,
    ) {
        let mut pending: HashMap<String, u32> =
            children.iter().map(|(i, id)| (id.clone(), *i)).collect();
        let tag = req.tag.clone();
        let result: Result<(), Status> = async {
            let called = Instant::now();
            let metrics = &self.ctx.metrics;
            let mut client = self.ctx.executors.client(&executor.id, &executor.addr)?;
            let mut stream = client.spawn(req).await?.into_inner();
            while let Some(ev) = stream.message().await? {
                metrics.spawn_phase(SpawnPhase::Executor, called.elapsed());
                let Some(index) = pending.remove(&ev.id) else {
                    tracing::warn!(executor = %executor.id, id = %ev.id, "executor reported a child it was not asked for");
                    continue;
                };
                // The executor's code and message reach the client unchanged.
                let failed = match ev.result {
                    Some(xpb::spawn_event::Result::ReadyUs(us)) => {
                        let updating = Instant::now();
                        let row = self.ctx.db.set_sandbox_ready(&ev.id, us).await?;
                        metrics.spawn_phase(SpawnPhase::Ready, updating.elapsed());
                        metrics.spawn_to_ready.observe(us as f64 / 1e6);
                        let msg = pb::SpawnEvent {
                            index,
                            result: row.map(|r| pb::spawn_event::Result::Ready(sandbox_msg(&r))),
                        };
                        let _ = tx.send(Ok(msg)).await;
                        continue;
                    }
                    Some(xpb::spawn_event::Result::Failure(e)) => from_child_error(&e),
                    // An executor from before typed errors: a message only.
                    Some(xpb::spawn_event::Result::Error(m)) => Status::internal(m),
                    None => continue,
                };
                self.ctx
                    .db
                    .end_sandbox(&ev.id, SandboxState::Failed, Some(failed.message()))
                    .await?;
                let msg = failure_event(index, &ev.id, &executor.id, failed.code(), failed.message());
                let _ = tx.send(Ok(msg)).await;
            }
            Ok(())
        }
        .await;
        // Whatever the executor did not report failed: never drop a child silently.
        let (code, why) = match result {
            Ok(()) => (
                Code::Internal,
                "the executor ended the spawn without reporting this child".to_string(),
            ),
            Err(s) => (
                s.code(),
                format!("executor {}: {}", executor.id, s.message()),
            ),
        };
        for (id, index) in pending {
            let _ = self
                .ctx
                .db
                .end_sandbox(&id, SandboxState::Failed, Some(&why))
                .await;
            let _ = tx
                .send(Ok(failure_event(index, &id, &executor.id, code, &why)))
                .await;
        }
        tracing::debug!(tag = %tag, executor = %executor.id, "spawn group done");
    }

    async fn kill_inner(&self, id: &str) -> Result<pb::KillSandboxResponse, Status> {
        validate::name("id", id)?;
        let at = self
            .ctx
            .db
            .sandbox_at(id)
            .await?
            .ok_or_else(|| Status::not_found(format!("sandbox {id} does not exist")))?;
        let mut row = at.sandbox;
        if row.state().is_live() {
            let mut c = self.ctx.executors.client(&row.executor_id, &at.addr)?;
            let existed = c
                .kill(xpb::KillRequest { id: id.to_string() })
                .await?
                .into_inner()
                .existed;
            // Ended meanwhile (expired, failed, or lost before the kill came): it keeps how it
            // ended.
            row = match self.ctx.db.end_killed(id, None, existed).await? {
                Some(r) => r,
                None => self
                    .ctx
                    .db
                    .sandbox(id)
                    .await?
                    .ok_or_else(|| Status::internal("sandbox vanished"))?,
            };
        }
        Ok(pb::KillSandboxResponse {
            sandbox: Some(sandbox_msg(&row)),
        })
    }

    async fn write_file_inner(
        &self,
        mut incoming: Streaming<pb::WriteFileRequest>,
        args: &mut serde_json::Value,
    ) -> Result<pb::WriteFileResponse, Status> {
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
        *args = json!({"sandbox_id": header.sandbox_id, "path": header.path, "mode": header.mode});
        validate::guest_path("path", &header.path)?;
        let mut client = self.sandbox_client(&header.sandbox_id).await?;
        // Relay the data; if the caller's stream breaks, abandon the upstream call so the
        // executor never mistakes a truncated upload for a complete one.
        let (broken_tx, broken_rx) = tokio::sync::oneshot::channel::<Status>();
        let mut broken_tx = Some(broken_tx);
        let first = futures::stream::once(async move {
            pb::WriteFileRequest {
                part: Some(pb::write_file_request::Part::Header(header)),
            }
        });
        let rest = incoming.filter_map(move |m| {
            let out = match m {
                Ok(pb::WriteFileRequest {
                    part: Some(pb::write_file_request::Part::Data(d)),
                }) => Some(pb::WriteFileRequest {
                    part: Some(pb::write_file_request::Part::Data(d)),
                }),
                Ok(_) => {
                    if let Some(b) = broken_tx.take() {
                        let _ = b.send(Status::invalid_argument(
                            "only data may follow the WriteFile header",
                        ));
                    }
                    None
                }
                Err(e) => {
                    if let Some(b) = broken_tx.take() {
                        let _ = b.send(e);
                    }
                    None
                }
            };
            async move { out }
        });
        let call = client.write_file(first.chain(rest));
        tokio::select! {
            r = call => Ok(r?.into_inner()),
            Ok(s) = broken_rx => Err(Status::new(s.code(), format!("upload aborted: {}", s.message()))),
        }
    }
}

fn failure_event(
    index: u32,
    id: &str,
    executor: &str,
    code: Code,
    message: &str,
) -> pb::SpawnEvent {
    pb::SpawnEvent {
        index,
        result: Some(pb::spawn_event::Result::Failed(pb::SpawnFailure {
            sandbox_id: id.to_string(),
            executor: executor.to_string(),
            code: code_name(code).to_string(),
            message: message.to_string(),
        })),
    }
}

#[tonic::async_trait]
impl Snapshots for Api {
    async fn create_snapshot(
        &self,
        req: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let r = req.get_ref();
        let args = json!({"tag": r.tag, "image": r.image, "vcpus": r.vcpus, "mem_mib": r.mem_mib,
                          "warmup_evals": r.warmup_eval.len(), "executor": r.executor});
        let call = self.ctx.begin(Rpc::CreateSnapshot, &req, args)?;
        let res = self.create_snapshot_inner(req.into_inner()).await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn list_snapshots(
        &self,
        req: Request<pb::ListSnapshotsRequest>,
    ) -> Result<Response<pb::ListSnapshotsResponse>, Status> {
        let r = req.get_ref().clone();
        let call = self.ctx.begin(
            Rpc::ListSnapshots,
            &req,
            json!({"page_size": r.page_size, "page_token": r.page_token}),
        )?;
        let res = async {
            let list = "snapshots";
            let page = paging::request(list, r.page_size, &r.page_token)?;
            let after = page.after.as_ref().map(|a| (a.created_ms, a.key.as_str()));
            let rows = self.ctx.db.snapshots_page(after, page.size + 1).await?;
            let (rows, next_page_token) = paging::finish(list, &page, rows, |s| Cursor {
                created_ms: s.created_ms,
                key: s.tag.clone(),
            });
            Ok(pb::ListSnapshotsResponse {
                snapshots: rows.iter().map(snapshot_msg).collect(),
                next_page_token,
            })
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn get_snapshot(
        &self,
        req: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::GetSnapshotResponse>, Status> {
        let tag = req.get_ref().tag.clone();
        let call = self
            .ctx
            .begin(Rpc::GetSnapshot, &req, json!({"tag": tag}))?;
        let res =
            async {
                validate::name("tag", &tag)?;
                let s =
                    self.ctx.db.snapshot(&tag).await?.ok_or_else(|| {
                        Status::not_found(format!("snapshot {tag} does not exist"))
                    })?;
                Ok(pb::GetSnapshotResponse {
                    snapshot: Some(snapshot_msg(&s)),
                    ancestors: self
                        .ctx
                        .db
                        .ancestors(&tag)
                        .await?
                        .iter()
                        .map(snapshot_msg)
                        .collect(),
                    descendants: self
                        .ctx
                        .db
                        .descendants(&tag)
                        .await?
                        .iter()
                        .map(snapshot_msg)
                        .collect(),
                })
            }
            .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn delete_snapshot(
        &self,
        req: Request<pb::DeleteSnapshotRequest>,
    ) -> Result<Response<pb::DeleteSnapshotResponse>, Status> {
        let r = req.get_ref();
        let call = self.ctx.begin(
            Rpc::DeleteSnapshot,
            &req,
            json!({"tag": r.tag, "cascade": r.cascade}),
        )?;
        let res = self.delete_snapshot_inner(req.into_inner()).await;
        self.ctx.finish(call, res.map(Response::new))
    }
}

#[tonic::async_trait]
impl Sandboxes for Api {
    type SpawnStream = ReceiverStream<Result<pb::SpawnEvent, Status>>;
    type ExecStream = BoxStream<pb::ExecEvent>;
    type ReadFileStream = BoxStream<pb::FileChunk>;

    async fn spawn(
        &self,
        req: Request<pb::SpawnRequest>,
    ) -> Result<Response<Self::SpawnStream>, Status> {
        let r = req.get_ref();
        let p = r.placement.clone().unwrap_or_default();
        let res = r.resources.unwrap_or_default();
        let args = json!({"tag": r.tag, "count": r.count, "policy": p.policy, "executors": p.executors,
                          "ready_timeout_ms": r.ready_timeout_ms, "no_wait": r.no_wait,
                          "memory_limit_mib": res.memory_limit_mib, "cpu_millis": res.cpu_millis,
                          "sandbox_timeout_s": r.sandbox_timeout_s});
        let admitted = Instant::now();
        let call = self.ctx.begin(Rpc::Spawn, &req, args)?;
        self.ctx
            .metrics
            .spawn_phase(SpawnPhase::Admit, admitted.elapsed());
        let deadline = call_deadline(&req);
        let res = self.start_spawn(req.into_inner(), deadline, admitted).await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn list_sandboxes(
        &self,
        req: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let r = req.get_ref().clone();
        let call = self.ctx.begin(
            Rpc::ListSandboxes,
            &req,
            json!({"tag": r.tag, "all": r.all, "page_size": r.page_size, "page_token": r.page_token}),
        )?;
        let res = async {
            let tag = if r.tag.is_empty() {
                None
            } else {
                validate::name("tag", &r.tag)?;
                Some(r.tag.as_str())
            };
            let list = format!("sandboxes?tag={}&all={}", r.tag, r.all);
            let page = paging::request(&list, r.page_size, &r.page_token)?;
            let after = page.after.as_ref().map(|a| (a.created_ms, a.key.as_str()));
            let rows = self
                .ctx
                .db
                .sandboxes_page(tag, r.all, after, page.size + 1)
                .await?;
            let (rows, next_page_token) = paging::finish(&list, &page, rows, |s| Cursor {
                created_ms: s.created_ms,
                key: s.id.clone(),
            });
            Ok(pb::ListSandboxesResponse {
                sandboxes: rows.iter().map(sandbox_msg).collect(),
                next_page_token,
            })
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::GetSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let id = req.get_ref().id.clone();
        let call = self.ctx.begin(Rpc::GetSandbox, &req, json!({"id": id}))?;
        let res = async {
            validate::name("id", &id)?;
            let s = self
                .ctx
                .db
                .sandbox(&id)
                .await?
                .ok_or_else(|| Status::not_found(format!("sandbox {id} does not exist")))?;
            let mut msg = sandbox_msg(&s);
            if s.state() == SandboxState::Ready {
                msg.usage = self.usage(&s).await;
            }
            Ok(msg)
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn kill_sandbox(
        &self,
        req: Request<pb::KillSandboxRequest>,
    ) -> Result<Response<pb::KillSandboxResponse>, Status> {
        let id = req.get_ref().id.clone();
        let call = self.ctx.begin(Rpc::KillSandbox, &req, json!({"id": id}))?;
        let res = self.kill_inner(&id).await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn exec(
        &self,
        req: Request<pb::ExecRequest>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let r = req.get_ref();
        let args = json!({"sandbox_id": r.sandbox_id, "argv0": r.argv.first(), "args": r.argv.len(),
                          "timeout_ms": r.timeout_ms});
        let call = self.ctx.begin(Rpc::Exec, &req, args)?;
        let res = async {
            let r = req.into_inner();
            validate::argv(&r.argv)?;
            let mut c = self.sandbox_client(&r.sandbox_id).await?;
            let s: Self::ExecStream = Box::pin(c.exec(r).await?.into_inner());
            Ok(s)
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn eval(
        &self,
        req: Request<pb::EvalRequest>,
    ) -> Result<Response<pb::EvalResponse>, Status> {
        let r = req.get_ref();
        let args = json!({"sandbox_id": r.sandbox_id, "code_bytes": r.code.len(), "timeout_ms": r.timeout_ms});
        let call = self.ctx.begin(Rpc::Eval, &req, args)?;
        let res = async {
            let r = req.into_inner();
            validate::code("code", &r.code)?;
            let mut c = self.sandbox_client(&r.sandbox_id).await?;
            Ok(c.eval(r).await?.into_inner())
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn set_timeout(
        &self,
        req: Request<pb::SetTimeoutRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let r = req.get_ref().clone();
        let args = json!({"sandbox_id": r.sandbox_id, "timeout_s": r.timeout_s});
        let call = self.ctx.begin(Rpc::SetTimeout, &req, args)?;
        let res = async {
            validate::name("sandbox_id", &r.sandbox_id)?;
            let s = self.ctx.timeouts.check_set(r.timeout_s)?;
            let expires = now_ms() + i64::from(s) * 1000;
            match self.ctx.db.set_expiry(&r.sandbox_id, expires).await? {
                Some(row) => Ok(sandbox_msg(&row)),
                None => Err(match self.ctx.db.sandbox(&r.sandbox_id).await? {
                    Some(row) => Status::failed_precondition(format!(
                        "sandbox {} has ended ({})",
                        row.id,
                        row.state().as_str()
                    )),
                    None => Status::not_found(format!("sandbox {} does not exist", r.sandbox_id)),
                }),
            }
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn expose_port(
        &self,
        req: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::ExposePortResponse>, Status> {
        let r = req.get_ref();
        let args = json!({"sandbox_id": r.sandbox_id, "guest_port": r.guest_port});
        let call = self.ctx.begin(Rpc::ExposePort, &req, args)?;
        let res = async {
            let r = req.into_inner();
            validate::guest_port(r.guest_port)?;
            let mut c = self.sandbox_client(&r.sandbox_id).await?;
            Ok(c.expose_port(r).await?.into_inner())
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn read_file(
        &self,
        req: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let r = req.get_ref();
        let call = self.ctx.begin(
            Rpc::ReadFile,
            &req,
            json!({"sandbox_id": r.sandbox_id, "path": r.path}),
        )?;
        let res = async {
            let r = req.into_inner();
            validate::guest_path("path", &r.path)?;
            let mut c = self.sandbox_client(&r.sandbox_id).await?;
            let s: Self::ReadFileStream = Box::pin(c.read_file(r).await?.into_inner());
            Ok(s)
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn write_file(
        &self,
        req: Request<Streaming<pb::WriteFileRequest>>,
    ) -> Result<Response<pb::WriteFileResponse>, Status> {
        let mut call = self.ctx.begin(Rpc::WriteFile, &req, json!({}))?;
        let mut args = json!({});
        let res = self.write_file_inner(req.into_inner(), &mut args).await;
        call.args = args;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn branch(
        &self,
        req: Request<pb::BranchRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let r = req.get_ref();
        let call = self.ctx.begin(
            Rpc::Branch,
            &req,
            json!({"sandbox_id": r.sandbox_id, "tag": r.tag, "mode": r.mode, "no_wait": r.no_wait}),
        )?;
        let res = self.branch_inner(req.into_inner()).await;
        self.ctx.finish(call, res.map(Response::new))
    }
}

/// A call whose connection to its executor broke (the executor died or restarted) is
/// UNAVAILABLE and names the executor. tonic's channel reports it as UNKNOWN "transport
/// error"; the direct hop as UNAVAILABLE caused by [`crate::hop::Unreachable`].
fn executor_lost(executor: &str, e: Status) -> Status {
    let from_the_hop = || {
        std::iter::successors(std::error::Error::source(&e), |s| s.source())
            .any(|s| s.is::<tonic::transport::Error>() || s.is::<crate::hop::Unreachable>())
    };
    let broken = match e.code() {
        Code::Unknown => e.message() == "transport error" || from_the_hop(),
        Code::Unavailable => from_the_hop(),
        _ => false,
    };
    if broken {
        Status::unavailable(format!(
            "executor {executor} stopped answering (it died or restarted): {}",
            e.message()
        ))
    } else {
        e
    }
}

/// A credential named `executor:ID` (one token per executor) speaks for executor ID alone.
fn check_executor_credential(principal: &str, id: &str) -> Result<(), Status> {
    match tine_rpc::auth::bound_executor(principal) {
        Some(bound) if bound != id => Err(Status::permission_denied(format!(
            "token {principal:?} belongs to executor {bound:?}, not {id:?}"
        ))),
        _ => Ok(()),
    }
}

#[tonic::async_trait]
impl tine_proto::v1::executors_server::Executors for Api {
    async fn register_executor(
        &self,
        req: Request<pb::RegisterExecutorRequest>,
    ) -> Result<Response<pb::RegisterExecutorResponse>, Status> {
        let r = req.get_ref();
        let live = r.report.as_ref().map_or(0, |x| x.live_sandboxes.len());
        let call = self.ctx.begin(
            Rpc::RegisterExecutor,
            &req,
            json!({"id": r.id, "addr": r.addr, "live_sandboxes": live}),
        )?;
        let principal = call.principal.name.clone();
        let res = async {
            let r = req.into_inner();
            validate::name("id", &r.id)?;
            check_executor_credential(&principal, &r.id)?;
            validate::executor_addr(&r.addr)?;
            let report = report_from(r.report);
            for id in &report.live_sandboxes {
                validate::name("report.live_sandboxes", id)?;
            }
            self.ctx
                .db
                .upsert_executor(&r.id, &r.addr, &report, &principal)
                .await?;
            self.apply_ended(&r.id, &report).await?;
            let unknown = self.ctx.db.reconcile_sandboxes(&r.id, &report.live_sandboxes, self.ctx.lost_grace_ms).await?;
            tracing::info!(executor = %r.id, addr = %r.addr, live = report.live_sandboxes.len(), "executor registered");
            Ok(pb::RegisterExecutorResponse {
                heartbeat_interval_s: self.ctx.heartbeat_interval_s,
                unknown_sandboxes: unknown,
            })
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn heartbeat(
        &self,
        req: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let id = req.get_ref().id.clone();
        let call = self.ctx.begin(Rpc::Heartbeat, &req, json!({"id": id}))?;
        let principal = call.principal.name.clone();
        let res = async {
            validate::name("id", &id)?;
            check_executor_credential(&principal, &id)?;
            let report = report_from(req.into_inner().report);
            let registered = self.ctx.db.heartbeat(&id, &report, &principal).await?;
            let mut unknown_sandboxes = Vec::new();
            if registered {
                self.apply_ended(&id, &report).await?;
                unknown_sandboxes = self
                    .ctx
                    .db
                    .reconcile_sandboxes(&id, &report.live_sandboxes, self.ctx.lost_grace_ms)
                    .await?;
            }
            Ok(pb::HeartbeatResponse {
                registered,
                unknown_sandboxes,
            })
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn list_executors(
        &self,
        req: Request<pb::ListExecutorsRequest>,
    ) -> Result<Response<pb::ListExecutorsResponse>, Status> {
        let r = req.get_ref().clone();
        let call = self.ctx.begin(
            Rpc::ListExecutors,
            &req,
            json!({"page_size": r.page_size, "page_token": r.page_token}),
        )?;
        let res = async {
            let list = "executors";
            let page = paging::request(list, r.page_size, &r.page_token)?;
            let after = page.after.as_ref().map(|a| a.key.as_str());
            let rows = self.ctx.db.executors_page(after, page.size + 1).await?;
            let (rows, next_page_token) = paging::finish(list, &page, rows, |e| Cursor {
                created_ms: 0,
                key: e.id.clone(),
            });
            let copies = self.ctx.db.copies().await?;
            let executors = rows
                .iter()
                .map(|e| {
                    let tags = copies
                        .iter()
                        .filter(|(x, _)| *x == e.id)
                        .map(|(_, t)| t.clone())
                        .collect();
                    self.executor_msg(e, tags)
                })
                .collect();
            Ok(pb::ListExecutorsResponse {
                executors,
                next_page_token,
            })
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }

    async fn drain_executor(
        &self,
        req: Request<pb::DrainExecutorRequest>,
    ) -> Result<Response<pb::Executor>, Status> {
        let id = req.get_ref().id.clone();
        let call = self
            .ctx
            .begin(Rpc::DrainExecutor, &req, json!({"id": id}))?;
        let res = async {
            validate::name("id", &id)?;
            if !self.ctx.db.set_draining(&id).await? {
                return Err(Status::not_found(format!(
                    "executor {id} is not registered"
                )));
            }
            let e = self
                .ctx
                .db
                .executor(&id)
                .await?
                .ok_or_else(|| Status::internal("executor vanished"))?;
            let copies = self.ctx.db.copies().await?;
            let tags = copies
                .into_iter()
                .filter(|(x, _)| *x == id)
                .map(|(_, t)| t)
                .collect();
            Ok(self.executor_msg(&e, tags))
        }
        .await;
        self.ctx.finish(call, res.map(Response::new))
    }
}
