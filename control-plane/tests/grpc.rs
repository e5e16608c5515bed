//! The control plane over real loopback gRPC with a real SQLite file. The executors are test
//! doubles at the executor-API seam (real gRPC servers that answer without VMs), so placement,
//! restarts and relaying are checked without KVM.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use futures::{Stream, StreamExt};
use tine_control_plane::calls::Auth;
use tine_control_plane::db::{Db, NewSnapshot, NewState};
use tine_control_plane::server::{self, RunningServer, ServerConfig};
use tine_proto::executor::v1 as xpb;
use tine_proto::executor::v1::executor_server::{Executor, ExecutorServer};
use tine_proto::v1 as pb;
use tine_proto::v1::executors_client::ExecutorsClient;
use tine_proto::v1::sandboxes_client::SandboxesClient;
use tine_proto::v1::snapshots_client::SnapshotsClient;
use tine_rpc::auth::Bearer;
use tine_rpc::auth::{generate_token, Role, TokenEntry, TokenSet};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status, Streaming};

// ---------- a test executor at the gRPC seam ----------

#[derive(Default)]
struct FakeState {
    live: HashSet<String>,
    files: HashMap<(String, String), Vec<u8>>,
    deleted_tags: Vec<String>,
    spawn_calls: usize,
    /// Children it really has room for (None: unlimited), to play an executor whose
    /// capacity is smaller than the control plane believes.
    room: Option<usize>,
    /// The snapshot each child was spawned from (what its branches apply over).
    spawned_from: HashMap<String, String>,
    /// StartBranch holds its last event until this is notified (None: sends it at once).
    branch_gate: Option<Arc<tokio::sync::Notify>>,
    /// StartBranch ends with this error after the resume instead of the snapshot.
    branch_failure: Option<String>,
    /// What each Spawn call passed on as its children's resources.
    resources: Vec<Option<pb::Resources>>,
    /// Kill never answers (an executor that hangs).
    kill_hangs: bool,
    /// CreateSnapshot waits until this is notified (None: answers at once).
    create_gate: Option<Arc<tokio::sync::Notify>>,
    /// CreateSnapshot fails with this code and message (UNAVAILABLE: an executor that died).
    create_failure: Option<(Code, String)>,
    /// The tag of each CreateSnapshot call, in order.
    created_tags: Vec<String>,
}

#[derive(Clone, Default)]
struct FakeExecutor {
    state: Arc<Mutex<FakeState>>,
}

impl FakeExecutor {
    /// The snapshot a branch of a live child makes.
    fn branched(&self, r: &pb::BranchRequest) -> Result<pb::Snapshot, Status> {
        let st = self.state.lock().unwrap();
        if !st.live.contains(&r.sandbox_id) {
            return Err(Status::not_found(format!("no VM {}", r.sandbox_id)));
        }
        Ok(pb::Snapshot {
            tag: r.tag.clone(),
            parent_tag: st.spawned_from[&r.sandbox_id].clone(),
            vcpus: 1,
            mem_mib: 512,
            source_sandbox: r.sandbox_id.clone(),
            branch: Some(pb::BranchInfo {
                mode: r.mode,
                pause_us: 900,
                pages_written: 7,
                took_us: 1000,
                rebase_pause_us: 100,
            }),
            ..Default::default()
        })
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl Executor for FakeExecutor {
    type SpawnStream = ReceiverStream<Result<xpb::SpawnEvent, Status>>;
    type ExecStream = BoxStream<pb::ExecEvent>;
    type ReadFileStream = BoxStream<pb::FileChunk>;

    async fn info(
        &self,
        _: Request<xpb::InfoRequest>,
    ) -> Result<Response<pb::ExecutorReport>, Status> {
        Ok(Response::new(pb::ExecutorReport::default()))
    }

    async fn create_snapshot(
        &self,
        req: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let r = req.into_inner();
        let (gate, failure) = {
            let mut st = self.state.lock().unwrap();
            st.created_tags.push(r.tag.clone());
            (st.create_gate.clone(), st.create_failure.clone())
        };
        if let Some(g) = gate {
            g.notified().await;
        }
        if let Some((code, why)) = failure {
            return Err(Status::new(code, why));
        }
        Ok(Response::new(pb::Snapshot {
            tag: r.tag,
            image: r.image,
            vcpus: r.vcpus.max(1),
            mem_mib: 512,
            ..Default::default()
        }))
    }

    async fn branch(
        &self,
        req: Request<pb::BranchRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        Ok(Response::new(self.branched(&req.into_inner())?))
    }

    type StartBranchStream = ReceiverStream<Result<xpb::BranchEvent, Status>>;

    async fn start_branch(
        &self,
        req: Request<pb::BranchRequest>,
    ) -> Result<Response<Self::StartBranchStream>, Status> {
        let done = self.branched(&req.into_inner())?;
        let (gate, failure) = {
            let st = self.state.lock().unwrap();
            (st.branch_gate.clone(), st.branch_failure.clone())
        };
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let resumed = xpb::branch_event::Event::Resumed(xpb::BranchResumed {
            pause_us: 900,
            parent_tag: done.parent_tag.clone(),
        });
        tx.send(Ok(xpb::BranchEvent {
            event: Some(resumed),
        }))
        .await
        .unwrap();
        tokio::spawn(async move {
            if let Some(g) = gate {
                g.notified().await;
            }
            let last = match failure {
                Some(why) => Err(Status::internal(why)),
                None => Ok(xpb::BranchEvent {
                    event: Some(xpb::branch_event::Event::Done(done)),
                }),
            };
            let _ = tx.send(last).await;
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn delete_snapshot(
        &self,
        req: Request<xpb::DeleteSnapshotRequest>,
    ) -> Result<Response<xpb::DeleteSnapshotResponse>, Status> {
        self.state
            .lock()
            .unwrap()
            .deleted_tags
            .push(req.into_inner().tag);
        Ok(Response::new(xpb::DeleteSnapshotResponse { existed: true }))
    }

    async fn spawn(
        &self,
        req: Request<xpb::SpawnRequest>,
    ) -> Result<Response<Self::SpawnStream>, Status> {
        let r = req.into_inner();
        let (tx, rx) = tokio::sync::mpsc::channel(r.ids.len() + 1);
        let mut st = self.state.lock().unwrap();
        st.spawn_calls += 1;
        st.resources.push(r.resources);
        for (i, id) in r.ids.into_iter().enumerate() {
            if st.room.is_some_and(|room| st.live.len() >= room) {
                let full = Status::resource_exhausted("executor fake is full (1 of 1 VMs running)");
                let _ = tx.try_send(Ok(xpb::SpawnEvent {
                    id,
                    result: Some(xpb::spawn_event::Result::Failure(
                        tine_rpc::status::child_error(&full),
                    )),
                }));
                continue;
            }
            st.live.insert(id.clone());
            st.spawned_from.insert(id.clone(), r.tag.clone());
            let _ = tx.try_send(Ok(xpb::SpawnEvent {
                id,
                result: Some(xpb::spawn_event::Result::ReadyUs(1000 + i as u64)),
            }));
        }
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn kill(
        &self,
        req: Request<xpb::KillRequest>,
    ) -> Result<Response<xpb::KillResponse>, Status> {
        if self.state.lock().unwrap().kill_hangs {
            std::future::pending::<()>().await;
        }
        let existed = self.state.lock().unwrap().live.remove(&req.into_inner().id);
        Ok(Response::new(xpb::KillResponse { existed }))
    }

    async fn exec(
        &self,
        req: Request<pb::ExecRequest>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let r = req.into_inner();
        let out = r.argv.join(" ").into_bytes();
        let events = vec![
            Ok(pb::ExecEvent {
                event: Some(pb::exec_event::Event::Stdout(out)),
            }),
            Ok(pb::ExecEvent {
                event: Some(pb::exec_event::Event::Stderr(b"warn".to_vec())),
            }),
            Ok(pb::ExecEvent {
                event: Some(pb::exec_event::Event::Exit(pb::ExitStatus {
                    how: Some(pb::exit_status::How::Code(3)),
                    timed_out: false,
                })),
            }),
        ];
        Ok(Response::new(Box::pin(futures::stream::iter(events))))
    }

    async fn eval(
        &self,
        req: Request<pb::EvalRequest>,
    ) -> Result<Response<pb::EvalResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(pb::EvalResponse {
            value: Some(format!("evaluated {} on {}", r.code, r.sandbox_id)),
            ..Default::default()
        }))
    }

    async fn usage(
        &self,
        req: Request<xpb::UsageRequest>,
    ) -> Result<Response<pb::SandboxUsage>, Status> {
        // What a cgroup would count, made up from the id so the relay is visible.
        let id = req.into_inner().id;
        Ok(Response::new(pb::SandboxUsage {
            memory_current_bytes: 3 << 20,
            memory_max_bytes: 128 << 20,
            cpu_usage_us: id.len() as u64,
            ..Default::default()
        }))
    }

    async fn expose_port(
        &self,
        req: Request<pb::ExposePortRequest>,
    ) -> Result<Response<pb::ExposePortResponse>, Status> {
        let r = req.into_inner();
        Ok(Response::new(pb::ExposePortResponse {
            address: format!("exposed {} of {}", r.guest_port, r.sandbox_id),
        }))
    }

    async fn read_file(
        &self,
        req: Request<pb::ReadFileRequest>,
    ) -> Result<Response<Self::ReadFileStream>, Status> {
        let r = req.into_inner();
        let data = self
            .state
            .lock()
            .unwrap()
            .files
            .get(&(r.sandbox_id, r.path.clone()))
            .cloned()
            .ok_or_else(|| Status::not_found(format!("{} does not exist", r.path)))?;
        let size = data.len() as u64;
        let chunks: Vec<Result<pb::FileChunk, Status>> = data
            .chunks(1 << 20)
            .map(|c| {
                Ok(pb::FileChunk {
                    data: c.to_vec(),
                    mode: 0,
                    size: 0,
                })
            })
            .chain(std::iter::once(Ok(pb::FileChunk {
                data: vec![],
                mode: 0o644,
                size,
            })))
            .collect();
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    async fn write_file(
        &self,
        req: Request<Streaming<pb::WriteFileRequest>>,
    ) -> Result<Response<pb::WriteFileResponse>, Status> {
        let mut s = req.into_inner();
        let Some(pb::WriteFileRequest {
            part: Some(pb::write_file_request::Part::Header(h)),
        }) = s.message().await?
        else {
            return Err(Status::invalid_argument("header first"));
        };
        let mut data = Vec::new();
        while let Some(m) = s.message().await? {
            if let Some(pb::write_file_request::Part::Data(d)) = m.part {
                data.extend_from_slice(&d);
            }
        }
        let size = data.len() as u64;
        self.state
            .lock()
            .unwrap()
            .files
            .insert((h.sandbox_id, h.path), data);
        Ok(Response::new(pb::WriteFileResponse { size }))
    }
}

/// Serve a test executor that only accepts the cluster's executor token.
async fn start_executor(token: &str) -> (FakeExecutor, SocketAddr) {
    let fake = FakeExecutor::default();
    let set = Arc::new(
        TokenSet::new(&[TokenEntry {
            name: "cp".into(),
            role: Role::Executor,
            token: token.into(),
        }])
        .unwrap(),
    );
    let check = move |req: Request<()>| -> Result<Request<()>, Status> {
        set.authenticate(req.metadata())?;
        Ok(req)
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let svc = InterceptedService::new(ExecutorServer::new(fake.clone()), check);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
            ),
    );
    (fake, addr)
}

// ---------- harness ----------

struct Tokens {
    admin: String,
    user: String,
    executor: String,
}

fn tokens() -> Tokens {
    Tokens {
        admin: generate_token(),
        user: generate_token(),
        executor: generate_token(),
    }
}

fn config(dir: &Path, t: &Tokens) -> ServerConfig {
    ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        db_path: dir.join("tine.db"),
        auth: Auth::Tokens(
            TokenSet::new(&[
                TokenEntry {
                    name: "ops".into(),
                    role: Role::Admin,
                    token: t.admin.clone(),
                },
                TokenEntry {
                    name: "alice".into(),
                    role: Role::User,
                    token: t.user.clone(),
                },
                TokenEntry {
                    name: "executors".into(),
                    role: Role::Executor,
                    token: t.executor.clone(),
                },
            ])
            .unwrap(),
        ),
        audit_path: dir.join("audit.log"),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        tls: None,
        executor_token: Some(t.executor.clone()),
        executor_tokens: Default::default(),
        executor_ca: None,
        heartbeat_interval_s: 5,
        lost_grace_ms: 0,
        allow_plaintext_remote: false,
        sandbox_timeouts: Default::default(),
    }
}

type Svc = InterceptedService<Channel, Bearer>;

async fn channel(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn clients(
    addr: SocketAddr,
    token: Option<&str>,
) -> (
    SnapshotsClient<Svc>,
    SandboxesClient<Svc>,
    ExecutorsClient<Svc>,
) {
    let ch = channel(addr).await;
    let b = Bearer::new(token).unwrap();
    (
        SnapshotsClient::with_interceptor(ch.clone(), b.clone()),
        SandboxesClient::with_interceptor(ch.clone(), b.clone()),
        ExecutorsClient::with_interceptor(ch, b),
    )
}

async fn register(
    cp: SocketAddr,
    t: &Tokens,
    id: &str,
    addr: SocketAddr,
    max: u32,
    tags: &[&str],
    live: &[String],
) -> pb::RegisterExecutorResponse {
    let (_, _, mut ex) = clients(cp, Some(&t.executor)).await;
    ex.register_executor(pb::RegisterExecutorRequest {
        id: id.into(),
        addr: format!("http://{addr}"),
        report: Some(pb::ExecutorReport {
            capacity: Some(pb::Capacity {
                max_sandboxes: max,
                running_sandboxes: 0,
                mem_total_mib: 1024,
                mem_available_mib: 512,
            }),
            cached_tags: tags.iter().map(|s| s.to_string()).collect(),
            live_sandboxes: live.to_vec(),
            ended: vec![],
        }),
    })
    .await
    .unwrap()
    .into_inner()
}

async fn add_snapshot(cp: &RunningServer, tag: &str, parent: Option<&str>, executor: &str) {
    cp.ctx
        .db
        .insert_snapshot(&NewSnapshot {
            tag: tag.into(),
            parent_tag: parent.map(str::to_owned),
            image: "python-numpy".into(),
            vcpus: 1,
            mem_mib: 512,
            source_sandbox: None,
            executor_id: executor.into(),
            layers: None,
            state: tine_control_plane::db::NewState::Ready,
        })
        .await
        .unwrap();
}

async fn spawn_all(
    sb: &mut SandboxesClient<Svc>,
    tag: &str,
    n: u32,
    policy: pb::PlacementPolicy,
) -> Vec<pb::SpawnEvent> {
    let mut s = sb
        .spawn(pb::SpawnRequest {
            tag: tag.into(),
            count: n,
            resources: None,
            placement: Some(pb::Placement {
                policy: policy as i32,
                executors: vec![],
            }),
            ready_timeout_ms: 0,
            no_wait: false,
            network: None,
            sandbox_timeout_s: 0,
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    while let Some(ev) = s.next().await {
        out.push(ev.unwrap());
    }
    out.sort_by_key(|e| e.index);
    out
}

fn ready_on(events: &[pb::SpawnEvent]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for e in events {
        if let Some(pb::spawn_event::Result::Ready(s)) = &e.result {
            *m.entry(s.executor.clone()).or_default() += 1;
        }
    }
    m
}

fn failures(events: &[pb::SpawnEvent]) -> Vec<&pb::SpawnFailure> {
    events
        .iter()
        .filter_map(|e| match &e.result {
            Some(pb::spawn_event::Result::Failed(f)) => Some(f),
            _ => None,
        })
        .collect()
}

fn audit_lines(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("audit.log"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

// ---------- tests ----------

#[tokio::test]
async fn placement_across_three_executors() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let mut fakes = Vec::new();
    for id in ["ex-a", "ex-b", "ex-c"] {
        let (fake, addr) = start_executor(&t.executor).await;
        register(cp.addr, &t, id, addr, 4, &[], &[]).await;
        fakes.push(fake);
    }
    // ex-c does not hold the snapshot: it must get nothing.
    add_snapshot(&cp, "py", None, "ex-a").await;
    add_snapshot(&cp, "other", None, "ex-c").await;
    cp.ctx
        .db
        .heartbeat(
            "ex-b",
            &tine_control_plane::db::ExecutorReport {
                max_sandboxes: 4,
                cached_tags: vec!["py".into()],
                ..Default::default()
            },
            "executors",
        )
        .await
        .unwrap();

    let (_, mut sb, _) = clients(cp.addr, Some(&t.user)).await;
    let ev = spawn_all(&mut sb, "py", 4, pb::PlacementPolicy::Spread).await;
    assert_eq!(ev.len(), 4);
    let on = ready_on(&ev);
    assert_eq!(
        (on.get("ex-a"), on.get("ex-b"), on.get("ex-c")),
        (Some(&2), Some(&2), None),
        "{on:?}"
    );

    // Pack fills the fuller holder first: both have 2 left, ties go to the smaller id.
    let ev = spawn_all(&mut sb, "py", 2, pb::PlacementPolicy::Pack).await;
    assert_eq!(ready_on(&ev).get("ex-a"), Some(&2));

    // 2 slots left among holders: 5 asked, 2 ready, 3 reported failed (none dropped).
    let ev = spawn_all(&mut sb, "py", 5, pb::PlacementPolicy::Spread).await;
    assert_eq!(ev.len(), 5);
    let failed = failures(&ev);
    assert_eq!(failed.len(), 3);
    assert!(
        failed.iter().all(|f| f.code == "RESOURCE_EXHAUSTED"),
        "{failed:?}"
    );
    assert_eq!(
        ev.iter().map(|e| e.index).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    let live = sb
        .list_sandboxes(pb::ListSandboxesRequest {
            tag: "py".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert_eq!(live.len(), 8);
    assert!(live
        .iter()
        .all(|s| s.state == pb::SandboxState::Ready as i32 && s.ready_us >= 1000));

    // Draining ex-a sends new children elsewhere... nowhere here, as ex-b is full: clear error.
    let (_, _, mut admin_ex) = clients(cp.addr, Some(&t.admin)).await;
    admin_ex
        .drain_executor(pb::DrainExecutorRequest { id: "ex-a".into() })
        .await
        .unwrap();
    let (_, id) = {
        let s = &live[0];
        (s.executor.clone(), s.id.clone())
    };
    sb.kill_sandbox(pb::KillSandboxRequest { id: id.clone() })
        .await
        .unwrap();
    let killed = sb
        .get_sandbox(pb::GetSandboxRequest { id })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(killed.state, pb::SandboxState::Killed as i32);

    // Metrics saw the spawns.
    let metrics = http_get(cp.metrics_addr.unwrap(), "/metrics").await;
    assert!(
        metrics.contains("tine_spawn_to_ready_seconds_count 8"),
        "{metrics}"
    );
    assert!(
        metrics.contains("tine_rpcs_total{code=\"OK\",rpc=\"tine.v1.Sandboxes/Spawn\"} 3"),
        "{metrics}"
    );
    cp.shutdown().await.unwrap();
}

/// An executor that turns children away passes its code and message to the client unchanged.
#[tokio::test]
async fn executor_errors_reach_the_client_with_their_code() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (fake, addr) = start_executor(&t.executor).await;
    fake.state.lock().unwrap().room = Some(1);
    register(cp.addr, &t, "ex-a", addr, 4, &["py"], &[]).await;
    add_snapshot(&cp, "py", None, "ex-a").await;
    let (_, mut sb, _) = clients(cp.addr, Some(&t.user)).await;
    let ev = spawn_all(&mut sb, "py", 3, pb::PlacementPolicy::Spread).await;
    assert_eq!(ready_on(&ev).get("ex-a"), Some(&1));
    let failed = failures(&ev);
    assert_eq!(failed.len(), 2);
    for f in failed {
        assert_eq!(f.code, "RESOURCE_EXHAUSTED", "{f:?}");
        assert_eq!(f.executor, "ex-a");
        assert!(f.message.contains("executor fake is full"), "{f:?}");
    }
    cp.shutdown().await.unwrap();
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

#[tokio::test]
async fn lineage_queries_and_delete_rules() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 4, &[], &[]).await;
    // root -> mid -> leaf, root -> side
    add_snapshot(&cp, "root", None, "ex-a").await;
    add_snapshot(&cp, "mid", Some("root"), "ex-a").await;
    add_snapshot(&cp, "leaf", Some("mid"), "ex-a").await;
    add_snapshot(&cp, "side", Some("root"), "ex-a").await;

    let (mut sn, _, _) = clients(cp.addr, Some(&t.user)).await;
    let g = sn
        .get_snapshot(pb::GetSnapshotRequest { tag: "leaf".into() })
        .await
        .unwrap()
        .into_inner();
    let anc: Vec<String> = g.ancestors.iter().map(|s| s.tag.clone()).collect();
    assert_eq!(anc, vec!["mid", "root"]);
    assert!(g.descendants.is_empty());
    let g = sn
        .get_snapshot(pb::GetSnapshotRequest { tag: "root".into() })
        .await
        .unwrap()
        .into_inner();
    let desc: Vec<String> = g.descendants.iter().map(|s| s.tag.clone()).collect();
    assert_eq!(desc, vec!["mid", "side", "leaf"]);
    assert_eq!(g.snapshot.unwrap().executors, vec!["ex-a"]);

    let err = sn
        .delete_snapshot(pb::DeleteSnapshotRequest {
            tag: "root".into(),
            cascade: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("leaf") && err.message().contains("cascade"),
        "{}",
        err.message()
    );
    assert_eq!(
        sn.list_snapshots(pb::ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .snapshots
            .len(),
        4
    );

    let d = sn
        .delete_snapshot(pb::DeleteSnapshotRequest {
            tag: "leaf".into(),
            cascade: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.deleted, vec!["leaf"]);
    let d = sn
        .delete_snapshot(pb::DeleteSnapshotRequest {
            tag: "root".into(),
            cascade: true,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.deleted.len(), 3);
    assert_eq!(d.deleted.last().unwrap(), "root", "children before parents");
    assert!(sn
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .snapshots
        .is_empty());
    let mut freed = fake.state.lock().unwrap().deleted_tags.clone();
    freed.sort();
    assert_eq!(freed, vec!["leaf", "mid", "root", "side"]);
    let err = sn
        .get_snapshot(pb::GetSnapshotRequest { tag: "root".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);

    // Create goes through an executor and records where the snapshot lives.
    let s = sn
        .create_snapshot(pb::CreateSnapshotRequest {
            tag: "fresh".into(),
            image: "python-numpy".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((s.executors, s.mem_mib), (vec!["ex-a".to_string()], 512));
    let err = sn
        .create_snapshot(pb::CreateSnapshotRequest {
            tag: "fresh".into(),
            image: "python-numpy".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn restart_keeps_everything_and_executors_readopt_their_sandboxes() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 8, &[], &[]).await;
    add_snapshot(&cp, "py", None, "ex-a").await;
    let (_, mut sb, _) = clients(cp.addr, Some(&t.user)).await;
    let ev = spawn_all(&mut sb, "py", 3, pb::PlacementPolicy::Spread).await;
    assert_eq!(ready_on(&ev).get("ex-a"), Some(&3));
    cp.shutdown().await.unwrap();

    // Same database, new process-equivalent: nothing lost.
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (mut sn, mut sb, _) = clients(cp.addr, Some(&t.user)).await;
    assert_eq!(
        sn.list_snapshots(pb::ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .snapshots
            .len(),
        1
    );
    let before = sb
        .list_sandboxes(pb::ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    assert_eq!(before.len(), 3);

    // The executor re-registers: it still runs two of them, one died meanwhile, and it runs
    // one the control plane never heard of.
    let mut live: Vec<String> = fake.state.lock().unwrap().live.iter().cloned().collect();
    live.sort();
    let dead = live.pop().unwrap();
    live.push("sbx-stranger".into());
    let r = register(cp.addr, &t, "ex-a", addr, 8, &["py"], &live).await;
    assert_eq!(r.unknown_sandboxes, vec!["sbx-stranger"]);
    let after = sb
        .list_sandboxes(pb::ListSandboxesRequest {
            all: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes;
    for s in &after {
        let want = if s.id == dead {
            pb::SandboxState::Lost
        } else {
            pb::SandboxState::Ready
        };
        assert_eq!(s.state, want as i32, "{s:?}");
    }
    // Re-adopted sandboxes are usable through the control plane.
    let alive = after.iter().find(|s| s.id != dead).unwrap();
    let v = sb
        .eval(pb::EvalRequest {
            sandbox_id: alive.id.clone(),
            code: "1 + 1".into(),
            timeout_ms: 0,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(v.value.unwrap(), format!("evaluated 1 + 1 on {}", alive.id));
    // Exposing a port goes to the sandbox's executor; a port outside 1..=65535 is refused.
    let port = |guest_port| pb::ExposePortRequest {
        sandbox_id: alive.id.clone(),
        guest_port,
    };
    let e = sb.expose_port(port(8000)).await.unwrap().into_inner();
    assert_eq!(e.address, format!("exposed 8000 of {}", alive.id));
    for bad in [0, 65536] {
        let err = sb.expose_port(port(bad)).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{bad}");
    }
    let err = sb
        .eval(pb::EvalRequest {
            sandbox_id: dead.clone(),
            code: "1".into(),
            timeout_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn exec_and_files_are_relayed() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (_fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 8, &[], &[]).await;
    add_snapshot(&cp, "py", None, "ex-a").await;
    let (_, mut sb, _) = clients(cp.addr, Some(&t.user)).await;
    let ev = spawn_all(&mut sb, "py", 1, pb::PlacementPolicy::Spread).await;
    let Some(pb::spawn_event::Result::Ready(s)) = &ev[0].result else {
        panic!("{ev:?}")
    };

    let mut out = sb
        .exec(pb::ExecRequest {
            sandbox_id: s.id.clone(),
            argv: vec!["echo".into(), "hi".into()],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut events = Vec::new();
    while let Some(e) = out.next().await {
        events.push(e.unwrap().event.unwrap());
    }
    assert_eq!(events.len(), 3);
    assert!(matches!(&events[0], pb::exec_event::Event::Stdout(d) if d == b"echo hi"));
    assert!(matches!(
        &events[2],
        pb::exec_event::Event::Exit(pb::ExitStatus {
            how: Some(pb::exit_status::How::Code(3)),
            ..
        })
    ));

    // 3.5 MiB up in 1 MiB chunks and back.
    let data: Vec<u8> = (0..(3 << 20) + (1 << 19))
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    let mut msgs = vec![pb::WriteFileRequest {
        part: Some(pb::write_file_request::Part::Header(pb::WriteFileHeader {
            sandbox_id: s.id.clone(),
            path: "/tmp/x".into(),
            mode: 0o600,
        })),
    }];
    msgs.extend(data.chunks(1 << 20).map(|c| pb::WriteFileRequest {
        part: Some(pb::write_file_request::Part::Data(c.to_vec())),
    }));
    let w = sb
        .write_file(futures::stream::iter(msgs))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(w.size, data.len() as u64);
    let mut back = Vec::new();
    let mut r = sb
        .read_file(pb::ReadFileRequest {
            sandbox_id: s.id.clone(),
            path: "/tmp/x".into(),
        })
        .await
        .unwrap()
        .into_inner();
    while let Some(c) = r.next().await {
        back.extend_from_slice(&c.unwrap().data);
    }
    assert!(back == data);

    // A relative path never reaches the executor.
    let err = sb
        .read_file(pb::ReadFileRequest {
            sandbox_id: s.id.clone(),
            path: "etc/passwd".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);

    // Branch: a mode it does not know is refused, not taken as another.
    let err = sb
        .branch(pb::BranchRequest {
            sandbox_id: s.id.clone(),
            tag: "b".into(),
            mode: 9,
            no_wait: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{}", err.message());
    let err = sb
        .branch(pb::BranchRequest {
            sandbox_id: "sbx-0000000000000000".into(),
            tag: "b".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    // A branch is recorded as a child of the sandbox's snapshot, made from that sandbox.
    let b = sb
        .branch(pb::BranchRequest {
            sandbox_id: s.id.clone(),
            tag: "b".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            b.parent_tag.as_str(),
            b.source_sandbox.as_str(),
            b.image.as_str()
        ),
        ("py", s.id.as_str(), "python-numpy")
    );
    assert_eq!(b.executors, vec!["ex-a"]);
    assert_eq!(b.branch.unwrap().pages_written, 7);
    let (mut sn, _, _) = clients(cp.addr, Some(&t.user)).await;
    let g = sn
        .get_snapshot(pb::GetSnapshotRequest { tag: "b".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        g.ancestors
            .iter()
            .map(|a| a.tag.as_str())
            .collect::<Vec<_>>(),
        vec!["py"]
    );
    let err = sb
        .branch(pb::BranchRequest {
            sandbox_id: s.id.clone(),
            tag: "b".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let err = sn
        .delete_snapshot(pb::DeleteSnapshotRequest {
            tag: "py".into(),
            cascade: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    // Children of the branch are placed where it is.
    let ev = spawn_all(&mut sb, "b", 2, pb::PlacementPolicy::Spread).await;
    assert_eq!(ready_on(&ev).get("ex-a"), Some(&2));
    cp.shutdown().await.unwrap();
}

async fn snapshot_state(sn: &mut SnapshotsClient<Svc>, tag: &str) -> (pb::SnapshotState, String) {
    let s = sn
        .get_snapshot(pb::GetSnapshotRequest { tag: tag.into() })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    (s.state(), s.error)
}

/// `tag`'s state once it is no longer WRITING (or after 4 s).
async fn settled_state(sn: &mut SnapshotsClient<Svc>, tag: &str) -> (pb::SnapshotState, String) {
    let mut state = snapshot_state(sn, tag).await;
    for _ in 0..200 {
        if state.0 != pb::SnapshotState::Writing {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        state = snapshot_state(sn, tag).await;
    }
    state
}

fn branch_req(id: &str, tag: &str, mode: pb::BranchMode, no_wait: bool) -> pb::BranchRequest {
    pb::BranchRequest {
        sandbox_id: id.into(),
        tag: tag.into(),
        mode: mode as i32,
        no_wait,
    }
}

fn with_network(
    mut r: pb::SpawnRequest,
    allow: &[&str],
    deny: &[&str],
    internet: i32,
) -> pb::SpawnRequest {
    r.network = Some(pb::Network {
        internet,
        allow: allow.iter().map(|s| s.to_string()).collect(),
        deny: deny.iter().map(|s| s.to_string()).collect(),
    });
    r
}

fn spawn_one(tag: &str, no_wait: bool) -> pb::SpawnRequest {
    pb::SpawnRequest {
        tag: tag.into(),
        count: 1,
        no_wait,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_branch_that_does_not_wait_is_writing_until_its_executor_finishes() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 8, &[], &[]).await;
    add_snapshot(&cp, "py", None, "ex-a").await;
    let (mut sn, mut sb, _) = clients(cp.addr, Some(&t.user)).await;
    let ev = spawn_all(&mut sb, "py", 1, pb::PlacementPolicy::Spread).await;
    let Some(pb::spawn_event::Result::Ready(s)) = &ev[0].result else {
        panic!("{ev:?}")
    };
    let gate = Arc::new(tokio::sync::Notify::new());
    fake.state.lock().unwrap().branch_gate = Some(gate.clone());

    // The answer comes once the sandbox resumes, while the executor still writes.
    let b = sb
        .branch(branch_req(&s.id, "w", pb::BranchMode::Live, true))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(b.state(), pb::SnapshotState::Writing);
    assert_eq!((b.parent_tag.as_str(), b.vcpus, b.mem_mib), ("py", 1, 512));
    assert_eq!(b.branch.unwrap().pause_us, 900);
    assert!(b.executors.is_empty(), "{:?}", b.executors);
    assert_eq!(
        snapshot_state(&mut sn, "w").await.0,
        pb::SnapshotState::Writing
    );

    // Spawns asked not to wait are refused; others wait, bounded by their deadline.
    let err = sb.spawn(spawn_one("w", true)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("still being written"),
        "{}",
        err.message()
    );
    let mut req = Request::new(spawn_one("w", false));
    req.set_timeout(std::time::Duration::from_millis(600));
    let err = sb.spawn(req).await.unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{}", err.message());
    let err = sn
        .delete_snapshot(pb::DeleteSnapshotRequest {
            tag: "w".into(),
            cascade: false,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert_eq!(fake.state.lock().unwrap().spawn_calls, 1);

    // A waiting spawn goes ahead once the executor reports the snapshot complete.
    let mut waiting_sb = sb.clone();
    let waiting = tokio::spawn(async move {
        let mut req = Request::new(spawn_one("w", false));
        req.set_timeout(std::time::Duration::from_secs(30));
        let mut events = waiting_sb.spawn(req).await.unwrap().into_inner();
        let mut out = Vec::new();
        while let Some(ev) = events.next().await {
            out.push(ev.unwrap());
        }
        out
    });
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(!waiting.is_finished());
    gate.notify_one();
    let ev = waiting.await.unwrap();
    assert_eq!(ready_on(&ev).get("ex-a"), Some(&1), "{ev:?}");
    let w = sn
        .get_snapshot(pb::GetSnapshotRequest { tag: "w".into() })
        .await
        .unwrap()
        .into_inner()
        .snapshot
        .unwrap();
    assert_eq!(
        (w.state(), w.executors),
        (pb::SnapshotState::Ready, vec!["ex-a".to_string()])
    );

    // A branch that fails after the resume becomes FAILED with the executor's reason.
    let gate = Arc::new(tokio::sync::Notify::new());
    {
        let mut st = fake.state.lock().unwrap();
        st.branch_gate = Some(gate.clone());
        st.branch_failure = Some("writing the diff: No space left on device".into());
    }
    let f = sb
        .branch(branch_req(&s.id, "f", pb::BranchMode::Diff, true))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(f.state(), pb::SnapshotState::Writing);
    gate.notify_one();
    let state = settled_state(&mut sn, "f").await;
    assert_eq!(state.0, pb::SnapshotState::Failed);
    assert!(state.1.contains("No space left on device"), "{}", state.1);
    let err = sb.spawn(spawn_one("f", false)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(err.message().contains("No space left"), "{}", err.message());
    // A failed snapshot can be deleted and its tag branched again.
    sn.delete_snapshot(pb::DeleteSnapshotRequest {
        tag: "f".into(),
        cascade: false,
    })
    .await
    .unwrap();
    fake.state.lock().unwrap().branch_failure = None;
    fake.state.lock().unwrap().branch_gate = None;
    let again = sb
        .branch(branch_req(&s.id, "f", pb::BranchMode::Diff, false))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.state(), pb::SnapshotState::Ready);
    // Spawn audit records carry the flag.
    let spawns: Vec<_> = audit_lines(dir.path())
        .into_iter()
        .filter(|l| l["rpc"] == "tine.v1.Sandboxes/Spawn" && l["args"]["no_wait"] == true)
        .collect();
    assert!(!spawns.is_empty());
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_create_is_recorded_while_written_and_a_failed_one_is_replaced_with_its_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 8, &[], &[]).await;
    let (mut sn, _, _) = clients(cp.addr, Some(&t.user)).await;
    let create = |tag: &str| pb::CreateSnapshotRequest {
        tag: tag.into(),
        image: "python-numpy".into(),
        ..Default::default()
    };

    // While the executor works the snapshot is recorded as writing, on that executor.
    let gate = Arc::new(tokio::sync::Notify::new());
    fake.state.lock().unwrap().create_gate = Some(gate.clone());
    let mut sn2 = sn.clone();
    let call = tokio::spawn(async move { sn2.create_snapshot(create("c")).await });
    let mut state = None;
    for _ in 0..200 {
        if let Ok(r) = sn
            .get_snapshot(pb::GetSnapshotRequest { tag: "c".into() })
            .await
        {
            state = Some(r.into_inner().snapshot.unwrap().state());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(state, Some(pb::SnapshotState::Writing));
    // A second create of the tag meanwhile is refused, without reaching the executor.
    let err = sn.create_snapshot(create("c")).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    assert_eq!(fake.state.lock().unwrap().created_tags, vec!["c"]);
    // The caller hanging up does not strand the record: it is finished when the executor is.
    call.abort();
    let _ = call.await;
    gate.notify_one();
    let state = settled_state(&mut sn, "c").await;
    assert_eq!(state.0, pb::SnapshotState::Ready, "{}", state.1);
    fake.state.lock().unwrap().create_gate = None;

    // An executor that fails (dies) mid-create leaves a FAILED record with its reason,
    // never nothing: the tag is known, and so is where leftovers may be.
    fake.state.lock().unwrap().create_failure =
        Some((Code::Unavailable, "the executor went away".into()));
    let err = sn.create_snapshot(create("d")).await.unwrap_err();
    assert_eq!(err.code(), Code::Unavailable);
    let (state, why) = snapshot_state(&mut sn, "d").await;
    assert_eq!(state, pb::SnapshotState::Failed);
    assert!(why.contains("the executor went away"), "{why}");
    assert!(fake.state.lock().unwrap().deleted_tags.is_empty());
    // Creating it again first has the executor remove what the failed attempt left.
    fake.state.lock().unwrap().create_failure = None;
    let again = sn.create_snapshot(create("d")).await.unwrap().into_inner();
    assert_eq!(
        (again.state(), again.executors, again.mem_mib),
        (pb::SnapshotState::Ready, vec!["ex-a".to_string()], 512)
    );
    assert_eq!(fake.state.lock().unwrap().deleted_tags, vec!["d"]);
    // An executor that already holds a copy nobody recorded refuses, having made nothing:
    // the tag stays unrecorded (its copy is not the create's to delete).
    fake.state.lock().unwrap().create_failure =
        Some((Code::AlreadyExists, "snapshot x already exists".into()));
    let err = sn.create_snapshot(create("x")).await.unwrap_err();
    assert_eq!(err.code(), Code::AlreadyExists);
    let err = sn
        .get_snapshot(pb::GetSnapshotRequest { tag: "x".into() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
    fake.state.lock().unwrap().create_failure = None;
    assert_eq!(
        fake.state.lock().unwrap().created_tags,
        vec!["c", "d", "d", "x"]
    );
    cp.shutdown().await.unwrap();

    // A stop while a create was under way leaves its record writing (what a killed control
    // plane leaves; the lab's kill -9 scenario does it for real). The next start fails it,
    // so a retry need not wait out its deadline.
    let db = Db::open(&dir.path().join("tine.db")).await.unwrap();
    db.insert_snapshot(&NewSnapshot {
        tag: "e".into(),
        parent_tag: None,
        image: "python-numpy".into(),
        vcpus: 0,
        mem_mib: 0,
        source_sandbox: None,
        executor_id: "ex-a".into(),
        layers: None,
        state: NewState::Writing { until_ms: i64::MAX },
    })
    .await
    .unwrap();
    db.close().await;
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    register(cp.addr, &t, "ex-a", addr, 8, &[], &[]).await;
    let (mut sn, _, _) = clients(cp.addr, Some(&t.user)).await;
    let (state, why) = snapshot_state(&mut sn, "e").await;
    assert_eq!(state, pb::SnapshotState::Failed);
    assert!(why.contains("cut short"), "{why}");
    let e = sn.create_snapshot(create("e")).await.unwrap().into_inner();
    assert_eq!(e.state(), pb::SnapshotState::Ready);
    assert_eq!(fake.state.lock().unwrap().deleted_tags, vec!["d", "e"]);
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn auth_rejections_and_bad_input_are_audited_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (_fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 8, &[], &[]).await;
    add_snapshot(&cp, "py", None, "ex-a").await;

    let (mut anon, _, _) = clients(cp.addr, None).await;
    let e = anon
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let wrong = generate_token();
    let (_, mut bad_sb, _) = clients(cp.addr, Some(&wrong)).await;
    let e = bad_sb
        .spawn(pb::SpawnRequest {
            tag: "py".into(),
            count: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let (_, _, mut user_ex) = clients(cp.addr, Some(&t.user)).await;
    let e = user_ex
        .drain_executor(pb::DrainExecutorRequest { id: "ex-a".into() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    let (_, mut exec_sb, _) = clients(cp.addr, Some(&t.executor)).await;
    let e = exec_sb
        .spawn(pb::SpawnRequest {
            tag: "py".into(),
            count: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);

    let (_, mut sb, _) = clients(cp.addr, Some(&t.user)).await;
    let spawn = |tag: &str, count: u32| pb::SpawnRequest {
        tag: tag.into(),
        count,
        ..Default::default()
    };
    for (req, code) in [
        (spawn("py", 0), Code::InvalidArgument),
        (spawn("py", 1001), Code::InvalidArgument),
        (spawn("nope", 1), Code::NotFound),
        (spawn("a/b", 1), Code::InvalidArgument),
        (spawn("..", 1), Code::InvalidArgument),
        (spawn("../../etc", 1), Code::InvalidArgument),
        (
            with_network(spawn("py", 1), &["10.0.0.1/24"], &[], 0),
            Code::InvalidArgument,
        ),
        (
            with_network(spawn("py", 1), &[], &["10.0.0.0/8; flush ruleset"], 0),
            Code::InvalidArgument,
        ),
        (
            with_network(spawn("py", 1), &[], &[], 7),
            Code::InvalidArgument,
        ),
    ] {
        let e = sb.spawn(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {}", e.message());
    }
    // Oversized message: refused by the gate as its length prefix arrives.
    let big = "x".repeat(9 << 20);
    let e = sb
        .eval(pb::EvalRequest {
            sandbox_id: "sbx-1".into(),
            code: big,
            timeout_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    let e = sb
        .kill_sandbox(pb::KillSandboxRequest { id: "../x".into() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // Nothing was written by any rejected mutation.
    assert!(cp.ctx.db.sandboxes(None, true).await.unwrap().is_empty());
    assert!(!cp.ctx.db.executor("ex-a").await.unwrap().unwrap().draining);

    let lines = audit_lines(dir.path());
    let statuses: Vec<(&str, &str)> = lines
        .iter()
        .map(|l| (l["rpc"].as_str().unwrap(), l["status"].as_str().unwrap()))
        .collect();
    assert!(statuses.contains(&("tine.v1.Snapshots/ListSnapshots", "UNAUTHENTICATED")));
    assert!(statuses.contains(&("tine.v1.Executors/DrainExecutor", "PERMISSION_DENIED")));
    assert!(statuses.contains(&("tine.v1.Sandboxes/Spawn", "NOT_FOUND")));
    assert!(statuses.contains(&("tine.v1.Executors/RegisterExecutor", "OK")));
    let denied = lines
        .iter()
        .find(|l| l["status"] == "PERMISSION_DENIED")
        .unwrap();
    assert_eq!(denied["principal"], "alice");
    // Refused on its headers: its body (the arguments) was never read.
    assert_eq!(denied["args"]["before_handler"], true);
    assert!(denied["peer"].as_str().unwrap().starts_with("127.0.0.1:"));
    let unauth = lines
        .iter()
        .find(|l| l["status"] == "UNAUTHENTICATED")
        .unwrap();
    assert!(unauth["principal"].is_null());
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn exposure_rules() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let mut cfg = config(dir.path(), &t);
    cfg.listen = "0.0.0.0:0".parse().unwrap();
    cfg.auth = Auth::Disabled;
    let err = server::start(cfg).await.err().expect("refused").to_string();
    assert!(err.contains("without authentication"), "{err}");
    let mut cfg = config(dir.path(), &t);
    cfg.listen = "0.0.0.0:0".parse().unwrap();
    let err = server::start(cfg).await.err().expect("refused").to_string();
    assert!(err.contains("without TLS"), "{err}");
    // Loopback without auth is allowed (development), and says who called: "anonymous".
    let mut cfg = config(dir.path(), &t);
    cfg.auth = Auth::Disabled;
    let cp = server::start(cfg).await.unwrap();
    let (mut sn, _, _) = clients(cp.addr, None).await;
    sn.list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap();
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn tls_listener_serves_clients_that_trust_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
    let mut cfg = config(dir.path(), &t);
    cfg.tls = Some(server::TlsFiles { cert, key });
    let cp = server::start(cfg).await.unwrap();
    let port = cp.addr.port();

    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(ck.cert.pem()))
        .domain_name("localhost");
    let ch = Channel::from_shared(format!("https://localhost:{port}"))
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut sn = SnapshotsClient::with_interceptor(ch, Bearer::new(Some(&t.user)).unwrap());
    sn.list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap();

    // A plaintext client gets nowhere.
    let plain = Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(ch) = plain {
        let mut sn = SnapshotsClient::with_interceptor(ch, Bearer::new(Some(&t.user)).unwrap());
        assert!(sn
            .list_snapshots(pb::ListSnapshotsRequest::default())
            .await
            .is_err());
    }
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn resources_are_checked_recorded_and_ended_sandboxes_say_why() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 8, &["py"], &[]).await;
    add_snapshot(&cp, "py", None, "ex-a").await;
    let (_, mut sb, _) = clients(cp.addr, Some(&t.user)).await;
    let req = |memory_limit_mib, cpu_millis| pb::SpawnRequest {
        tag: "py".into(),
        count: 2,
        resources: Some(pb::Resources {
            memory_limit_mib,
            cpu_millis,
        }),
        ..Default::default()
    };
    // Below the floors, or past any host: refused, naming the field, before any executor.
    for (m, c, field) in [
        (16, 0, "resources.memory_limit_mib: 16 is outside 64"),
        (0, 5, "resources.cpu_millis: 5 is outside 10"),
        (u64::MAX, 0, "resources.memory_limit_mib"),
    ] {
        let e = sb.spawn(req(m, c)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with(field), "{e:?}");
    }
    assert_eq!(fake.state.lock().unwrap().spawn_calls, 0);

    let mut stream = sb.spawn(req(128, 250)).await.unwrap().into_inner();
    let mut ids = Vec::new();
    while let Some(ev) = stream.next().await {
        if let Some(pb::spawn_event::Result::Ready(s)) = ev.unwrap().result {
            ids.push(s.id);
        }
    }
    assert_eq!(ids.len(), 2);
    let want = Some(pb::Resources {
        memory_limit_mib: 128,
        cpu_millis: 250,
    });
    assert_eq!(fake.state.lock().unwrap().resources, vec![want]);
    let get = |sb: &mut SandboxesClient<Svc>, id: &str| {
        let mut sb = sb.clone();
        let id = id.to_string();
        async move {
            sb.get_sandbox(pb::GetSandboxRequest { id })
                .await
                .unwrap()
                .into_inner()
        }
    };
    // A ready sandbox reports its limits and what its executor counts.
    let s = get(&mut sb, &ids[0]).await;
    assert_eq!(s.resources, want);
    let u = s.usage.expect("usage of a ready sandbox");
    assert_eq!(u.memory_current_bytes, 3 << 20);
    assert_eq!(u.cpu_usage_us, ids[0].len() as u64);

    // The executor reports the first one killed at its memory limit, twice (two heartbeats).
    let (_, _, mut ex) = clients(cp.addr, Some(&t.executor)).await;
    let reason = "out of memory: its VMM was killed at its limit of 128 MiB";
    for _ in 0..2 {
        let registered = ex
            .heartbeat(pb::HeartbeatRequest {
                id: "ex-a".into(),
                report: Some(pb::ExecutorReport {
                    capacity: Some(pb::Capacity {
                        max_sandboxes: 8,
                        ..Default::default()
                    }),
                    cached_tags: vec!["py".into()],
                    live_sandboxes: vec![ids[1].clone()],
                    ended: vec![pb::EndedSandbox {
                        id: ids[0].clone(),
                        reason: reason.into(),
                        out_of_memory: true,
                    }],
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .registered;
        assert!(registered);
    }
    let s = get(&mut sb, &ids[0]).await;
    assert_eq!(s.state, pb::SandboxState::Failed as i32, "{s:?}");
    assert_eq!(s.error, reason);
    assert!(s.usage.is_none());
    assert_eq!(
        get(&mut sb, &ids[1]).await.state,
        pb::SandboxState::Ready as i32
    );

    // Audited once, with the spawn's limits on the spawn's own record; counted by cause.
    let lines = audit_lines(dir.path());
    let ended: Vec<_> = lines
        .iter()
        .filter(|l| l["rpc"] == "SandboxEnded")
        .collect();
    assert_eq!(ended.len(), 1, "{ended:?}");
    assert_eq!(ended[0]["args"]["id"], ids[0].as_str());
    assert_eq!(ended[0]["args"]["out_of_memory"], true);
    assert_eq!(ended[0]["principal"], "executor:ex-a");
    let spawn = lines
        .iter()
        .find(|l| l["rpc"] == "tine.v1.Sandboxes/Spawn" && l["status"] == "OK")
        .unwrap();
    assert_eq!(spawn["args"]["memory_limit_mib"], 128);
    assert_eq!(spawn["args"]["cpu_millis"], 250);
    let metrics = http_get(cp.metrics_addr.unwrap(), "/metrics").await;
    assert!(
        metrics.contains("tine_sandboxes_ended_total{cause=\"out_of_memory\"} 1"),
        "{metrics}"
    );
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn sandboxes_expire_on_time_even_across_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 8, &["py"], &[]).await;
    add_snapshot(&cp, "py", None, "ex-a").await;
    let (_, sb, _) = clients(cp.addr, Some(&t.user)).await;
    let spawn = |sb: &SandboxesClient<Svc>, sandbox_timeout_s: u32| {
        let mut sb = sb.clone();
        async move {
            let mut s = sb
                .spawn(pb::SpawnRequest {
                    tag: "py".into(),
                    count: 1,
                    sandbox_timeout_s,
                    ..Default::default()
                })
                .await?
                .into_inner();
            let mut out = None;
            while let Some(ev) = s.next().await {
                if let Some(pb::spawn_event::Result::Ready(x)) = ev?.result {
                    out = Some(x);
                }
            }
            Ok::<_, Status>(out.expect("a ready child"))
        }
    };
    // Over the maximum: refused, naming the field and the bound.
    let e = spawn(&sb, 86_401).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message()
            .contains("sandbox_timeout_s: 86401 is over the maximum of 86400 s"),
        "{e:?}"
    );

    // The default: five minutes from the spawn.
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let long = spawn(&sb, 0).await.unwrap();
    let left = long.expires_unix_ms - before;
    assert!((299_000..=301_000).contains(&left), "{left}");
    // SetTimeout moves it either way, within 1..=max.
    let set = |sb: &SandboxesClient<Svc>, id: &str, timeout_s: u32| {
        let mut sb = sb.clone();
        let sandbox_id = id.to_string();
        async move {
            sb.set_timeout(pb::SetTimeoutRequest {
                sandbox_id,
                timeout_s,
            })
            .await
            .map(|r| r.into_inner())
        }
    };
    let moved = set(&sb, &long.id, 3600).await.unwrap();
    assert!(moved.expires_unix_ms - before >= 3_599_000, "{moved:?}");
    for bad in [0, 86_401] {
        let e = set(&sb, &long.id, bad).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{bad}: {e:?}");
    }
    assert_eq!(
        set(&sb, "sbx-nope", 10).await.unwrap_err().code(),
        Code::NotFound
    );

    // One second: killed on its executor and recorded with why.
    let short = spawn(&sb, 1).await.unwrap();
    let get = |sb: &SandboxesClient<Svc>, id: &str| {
        let mut sb = sb.clone();
        let id = id.to_string();
        async move {
            sb.get_sandbox(pb::GetSandboxRequest { id })
                .await
                .unwrap()
                .into_inner()
        }
    };
    let t0 = std::time::Instant::now();
    while get(&sb, &short.id).await.state != pb::SandboxState::Killed as i32 {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "never expired"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let s = get(&sb, &short.id).await;
    assert!(
        s.error.starts_with("expired: its timeout ran out after"),
        "{s:?}"
    );
    assert!(!fake.state.lock().unwrap().live.contains(&short.id));
    assert!(
        fake.state.lock().unwrap().live.contains(&long.id),
        "only the due one"
    );
    // A later kill does not overwrite how it ended.
    let k = sb
        .clone()
        .kill_sandbox(pb::KillSandboxRequest {
            id: short.id.clone(),
        })
        .await
        .unwrap()
        .into_inner()
        .sandbox
        .unwrap();
    assert!(k.error.starts_with("expired:"), "{k:?}");
    // An ended sandbox's timeout cannot be set.
    let e = set(&sb, &short.id, 10).await.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");

    // Due while no control plane runs: killed at the next start.
    let doomed = spawn(&sb, 1).await.unwrap();
    cp.shutdown().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    assert!(fake.state.lock().unwrap().live.contains(&doomed.id));
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (_, sb, _) = clients(cp.addr, Some(&t.user)).await;
    let t0 = std::time::Instant::now();
    while get(&sb, &doomed.id).await.state != pb::SandboxState::Killed as i32 {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(10),
            "never expired after restart"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(!fake.state.lock().unwrap().live.contains(&doomed.id));

    // Audited (by the control plane itself) and counted.
    let expired: Vec<_> = audit_lines(dir.path())
        .into_iter()
        .filter(|l| l["rpc"] == "SandboxExpired")
        .collect();
    assert_eq!(expired.len(), 2, "{expired:?}");
    assert_eq!(expired[0]["principal"], "control-plane");
    let metrics = http_get(cp.metrics_addr.unwrap(), "/metrics").await;
    assert!(
        metrics.contains("tine_sandboxes_ended_total{cause=\"expired\"} 1"),
        "the restarted process counted its own: {metrics}"
    );
    cp.shutdown().await.unwrap();
}

#[tokio::test]
async fn an_executor_that_hangs_does_not_hold_up_other_expiries() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (hung, hung_addr) = start_executor(&t.executor).await;
    let (fine, fine_addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-hung", hung_addr, 8, &["a"], &[]).await;
    register(cp.addr, &t, "ex-fine", fine_addr, 8, &["b"], &[]).await;
    add_snapshot(&cp, "a", None, "ex-hung").await;
    add_snapshot(&cp, "b", None, "ex-fine").await;
    let (_, sb, _) = clients(cp.addr, Some(&t.user)).await;
    let spawn = |tag: &str, count: u32| {
        let mut sb = sb.clone();
        let tag = tag.to_string();
        async move {
            let mut s = sb
                .spawn(pb::SpawnRequest {
                    tag,
                    count,
                    sandbox_timeout_s: 1,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            let mut ids = Vec::new();
            while let Some(ev) = s.next().await {
                if let Some(pb::spawn_event::Result::Ready(x)) = ev.unwrap().result {
                    ids.push(x.id);
                }
            }
            ids
        }
    };
    // Three due on an executor whose kills never answer (5 s each, were they tried in turn),
    // one on a healthy executor, all due in the same instant.
    hung.state.lock().unwrap().kill_hangs = true;
    let stuck = spawn("a", 3).await;
    let due = spawn("b", 1).await;
    assert_eq!((stuck.len(), due.len()), (3, 1));
    let t0 = std::time::Instant::now();
    loop {
        let s = sb
            .clone()
            .get_sandbox(pb::GetSandboxRequest { id: due[0].clone() })
            .await
            .unwrap()
            .into_inner();
        if s.state == pb::SandboxState::Killed as i32 {
            break;
        }
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(4),
            "the healthy executor's sandbox waited behind the hung one's"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(!fine.state.lock().unwrap().live.contains(&due[0]));
    // The hung executor's sandboxes are still live, to be tried again.
    for id in &stuck {
        let s = sb
            .clone()
            .get_sandbox(pb::GetSandboxRequest { id: id.clone() })
            .await
            .unwrap()
            .into_inner();
        assert_ne!(s.state, pb::SandboxState::Killed as i32, "{id}");
    }
    cp.shutdown().await.unwrap();
}

/// With its audit log unwritable (a full disk), the control plane answers reads but refuses
/// every call that would act, saying why, and acts on none of them.
#[tokio::test]
async fn calls_that_act_are_refused_while_the_audit_log_cannot_be_written() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let mut cfg = config(dir.path(), &t);
    cfg.audit_path = PathBuf::from("/dev/full");
    let cp = server::start(cfg).await.unwrap();
    // Registering is a call that acts, so the executor's row is made directly.
    cp.ctx
        .db
        .upsert_executor(
            "ex-a",
            "http://127.0.0.1:1",
            &tine_control_plane::db::ExecutorReport::default(),
            "executors",
        )
        .await
        .unwrap();
    add_snapshot(&cp, "py", None, "ex-a").await;
    let (mut snaps, mut sb, _) = clients(cp.addr, Some(&t.admin)).await;
    let listed = snaps
        .list_snapshots(pb::ListSnapshotsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.snapshots.len(), 1, "reads are answered");
    let e = sb
        .spawn(pb::SpawnRequest {
            tag: "py".into(),
            count: 1,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(e.message().contains("audit log cannot be written"), "{e:?}");
    let e = snaps
        .delete_snapshot(pb::DeleteSnapshotRequest {
            tag: "py".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(
        cp.ctx.db.snapshot("py").await.unwrap().is_some(),
        "not deleted"
    );
    assert!(cp.ctx.db.sandboxes(None, true).await.unwrap().is_empty());
    cp.shutdown().await.unwrap();
}

/// A token named `executor:ID` speaks for executor ID alone, and an id belongs to the
/// credential it registered with: neither another executor's token nor the shared cluster
/// token can take it over (register or heartbeat), while its own token always can.
#[tokio::test]
async fn an_executor_id_belongs_to_its_own_credential() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let (a, b) = (generate_token(), generate_token());
    let mut cfg = config(dir.path(), &t);
    cfg.auth = Auth::Tokens(
        TokenSet::new(&[
            TokenEntry {
                name: "ops".into(),
                role: Role::Admin,
                token: t.admin.clone(),
            },
            TokenEntry {
                name: "executors".into(),
                role: Role::Executor,
                token: t.executor.clone(),
            },
            TokenEntry {
                name: "executor:ex-a".into(),
                role: Role::Executor,
                token: a.clone(),
            },
            TokenEntry {
                name: "executor:ex-b".into(),
                role: Role::Executor,
                token: b.clone(),
            },
        ])
        .unwrap(),
    );
    // The control plane calls ex-a with ex-a's own token (the fake accepts only that one).
    cfg.executor_tokens = [("ex-a".to_string(), a.clone())].into();
    let (_fake, fake_addr) = start_executor(&a).await;
    let fake_addr: &'static str = Box::leak(format!("http://{fake_addr}").into_boxed_str());
    let cp = server::start(cfg).await.unwrap();
    let report = || {
        Some(pb::ExecutorReport {
            capacity: Some(pb::Capacity {
                max_sandboxes: 4,
                ..Default::default()
            }),
            ..Default::default()
        })
    };
    let register = |token: String, id: &'static str, addr: &'static str| {
        let cp = cp.addr;
        async move {
            let (_, _, mut ex) = clients(cp, Some(&token)).await;
            ex.register_executor(pb::RegisterExecutorRequest {
                id: id.into(),
                addr: addr.into(),
                report: report(),
            })
            .await
        }
    };
    let heartbeat = |token: String, id: &'static str| {
        let cp = cp.addr;
        async move {
            let (_, _, mut ex) = clients(cp, Some(&token)).await;
            ex.heartbeat(pb::HeartbeatRequest {
                id: id.into(),
                report: report(),
            })
            .await
        }
    };
    register(a.clone(), "ex-a", fake_addr).await.unwrap();
    let e = register(b.clone(), "ex-a", "http://127.0.0.1:7666")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("belongs to executor \"ex-b\""),
        "{e:?}"
    );
    let e = register(t.executor.clone(), "ex-a", "http://127.0.0.1:7666")
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("another credential"), "{e:?}");
    let hb = heartbeat(t.executor.clone(), "ex-a")
        .await
        .unwrap()
        .into_inner();
    assert!(
        !hb.registered,
        "a heartbeat from another credential does not count"
    );
    let row = cp.ctx.db.executor("ex-a").await.unwrap().unwrap();
    assert_eq!(row.addr, fake_addr, "the address was not taken over");
    let hb = heartbeat(a.clone(), "ex-a").await.unwrap().into_inner();
    assert!(hb.registered);
    add_snapshot(&cp, "py", None, "ex-a").await;
    let (_, mut sb, _) = clients(cp.addr, Some(&t.admin)).await;
    let events = spawn_all(&mut sb, "py", 1, pb::PlacementPolicy::Spread).await;
    assert_eq!(ready_on(&events).get("ex-a"), Some(&1), "{events:?}");
    // Its own token re-registers (a restart), and the shared token registers unclaimed ids.
    register(a, "ex-a", fake_addr).await.unwrap();
    register(t.executor.clone(), "ex-c", "http://127.0.0.1:7003")
        .await
        .unwrap();
    let denied: Vec<_> = audit_lines(dir.path())
        .into_iter()
        .filter(|l| {
            l["rpc"] == "tine.v1.Executors/RegisterExecutor" && l["status"] == "PERMISSION_DENIED"
        })
        .collect();
    assert_eq!(denied.len(), 2, "{denied:?}");
    assert_eq!(denied[1]["principal"], "executors");
    cp.shutdown().await.unwrap();
}

/// A raw HTTP/2 gRPC call: a length prefix declaring `declared` bytes, then `sent`, then the
/// body stalls (or ends, with `end`). The answer's gRPC status (code, message), or None if
/// there was none within 3 s.
async fn raw_call(
    addr: SocketAddr,
    path: &str,
    token: Option<&str>,
    declared: u32,
    sent: &[u8],
    end: bool,
) -> Option<(Code, String)> {
    use bytes::Bytes;
    use http_body::Frame;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::convert::Infallible>>(4);
    let mut first = vec![0u8];
    first.extend_from_slice(&declared.to_be_bytes());
    first.extend_from_slice(sent);
    tx.send(Ok(Frame::data(Bytes::from(first)))).await.unwrap();
    let _held = (!end).then_some(tx);
    let mut req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req
        .body(http_body_util::StreamBody::new(ReceiverStream::new(rx)))
        .unwrap();
    let resp = tokio::time::timeout(std::time::Duration::from_secs(3), send.send_request(req))
        .await
        .ok()?
        .unwrap();
    let status = match Status::from_header_map(resp.headers()) {
        Some(s) => s,
        None => {
            use http_body_util::BodyExt;
            let body = tokio::time::timeout(
                std::time::Duration::from_secs(3),
                resp.into_body().collect(),
            )
            .await
            .ok()?
            .unwrap();
            Status::from_header_map(body.trailers()?)?
        }
    };
    Some((status.code(), status.message().to_string()))
}

/// Calls are judged on their headers: no token, or a message over the call's limit, is
/// answered before the body has arrived (the bodies here never finish). Calls that never
/// reach a handler are audited and counted.
#[tokio::test]
async fn calls_are_refused_on_their_headers_before_their_body_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let eval = "/tine.v1.Sandboxes/Eval";
    let get = "/tine.v1.Sandboxes/GetSandbox";

    // No token: 4 MiB declared, 1 KiB sent. Before the gate, the decoder waited for the rest.
    let (code, msg) = raw_call(cp.addr, eval, None, 4 << 20, &[b'x'; 1024], false)
        .await
        .expect("an unauthenticated call was held while its body was awaited");
    assert_eq!(code, Code::Unauthenticated, "{msg}");
    let (code, _) = raw_call(cp.addr, eval, Some(&generate_token()), 4 << 20, b"", false)
        .await
        .expect("a call with a wrong token was held");
    assert_eq!(code, Code::Unauthenticated);

    // A known caller, a message over this call's limit (64 KiB for GetSandbox): refused as
    // soon as its length prefix arrives.
    let (code, msg) = raw_call(cp.addr, get, Some(&t.user), 1 << 20, &[1; 100], false)
        .await
        .expect("an oversized call was held while its body was awaited");
    assert_eq!(code, Code::ResourceExhausted, "{msg}");
    assert!(msg.contains("limit of 65536 bytes"), "{msg}");
    // The same size is fine for a call that carries code (held open: its body never ends).
    assert_eq!(
        raw_call(cp.addr, eval, Some(&t.user), 1 << 20, &[1; 100], false).await,
        None
    );

    // Undecodable and unknown: answered without a handler, audited all the same.
    let (code, _) = raw_call(cp.addr, get, Some(&t.user), 6, &[0xff; 6], true)
        .await
        .unwrap();
    assert_ne!(code, Code::Ok);
    let undecodable = code;
    let (code, _) = raw_call(
        cp.addr,
        "/tine.v1.Sandboxes/Nope",
        Some(&t.user),
        0,
        b"",
        true,
    )
    .await
    .unwrap();
    assert_eq!(code, Code::Unimplemented);
    let (code, _) = raw_call(cp.addr, "/tine.v1.Sandboxes/Nope", None, 0, b"", true)
        .await
        .unwrap();
    assert_eq!(code, Code::Unauthenticated);

    let lines = audit_lines(dir.path());
    let refused: Vec<(&str, &str, Option<&str>)> = lines
        .iter()
        .filter(|l| l["args"]["before_handler"] == true)
        .map(|l| {
            (
                l["rpc"].as_str().unwrap(),
                l["status"].as_str().unwrap(),
                l["principal"].as_str(),
            )
        })
        .collect();
    let undecodable = tine_rpc::status::code_name(undecodable);
    for expected in [
        ("tine.v1.Sandboxes/Eval", "UNAUTHENTICATED", None),
        (
            "tine.v1.Sandboxes/GetSandbox",
            "RESOURCE_EXHAUSTED",
            Some("alice"),
        ),
        ("tine.v1.Sandboxes/GetSandbox", undecodable, Some("alice")),
        ("tine.v1/unknown", "UNIMPLEMENTED", Some("alice")),
        ("tine.v1/unknown", "UNAUTHENTICATED", None),
    ] {
        assert!(
            refused.contains(&expected),
            "{expected:?} not in {refused:?}"
        );
    }
    // And the held Eval, cut off by its client before its message was whole.
    assert!(refused
        .iter()
        .any(|r| r.0 == "tine.v1.Sandboxes/Eval" && r.2 == Some("alice")));
    assert_eq!(refused.len(), 7, "{refused:?}");
    let metrics = http_get(cp.metrics_addr.unwrap(), "/metrics").await;
    assert!(
        metrics.contains(
            "tine_rpcs_total{code=\"RESOURCE_EXHAUSTED\",rpc=\"tine.v1.Sandboxes/GetSandbox\"} 1"
        ),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("tine_rpcs_total{code=\"UNAUTHENTICATED\",rpc=\"tine.v1.Sandboxes/Eval\"} 2"),
        "{metrics}"
    );
    cp.shutdown().await.unwrap();
}

/// Every page of ListSandboxes(tag, all) at `size` a page; the ids in order.
async fn sandbox_pages(
    sb: &mut SandboxesClient<Svc>,
    all: bool,
    size: u32,
) -> (Vec<String>, usize) {
    let (mut ids, mut pages, mut token) = (Vec::new(), 0, String::new());
    loop {
        let r = sb
            .list_sandboxes(pb::ListSandboxesRequest {
                all,
                page_size: size,
                page_token: token,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        pages += 1;
        assert!(size == 0 || r.sandboxes.len() <= size as usize);
        ids.extend(r.sandboxes.into_iter().map(|s| s.id));
        if r.next_page_token.is_empty() {
            return (ids, pages);
        }
        token = r.next_page_token;
    }
}

/// Lists come in pages whose tokens continue only their own list; ended sandboxes are
/// forgotten after the history retention (here 1 s, applied when a control plane starts).
#[tokio::test]
async fn lists_are_paged_and_ended_sandboxes_are_forgotten_after_the_retention() {
    let dir = tempfile::tempdir().unwrap();
    let t = tokens();
    let cp = server::start(config(dir.path(), &t)).await.unwrap();
    let (_fake, addr) = start_executor(&t.executor).await;
    register(cp.addr, &t, "ex-a", addr, 16, &[], &[]).await;
    for tag in ["a", "b", "c"] {
        add_snapshot(&cp, tag, None, "ex-a").await;
    }
    let (mut sn, mut sb, mut ex) = clients(cp.addr, Some(&t.admin)).await;
    let ev = spawn_all(&mut sb, "a", 7, pb::PlacementPolicy::Spread).await;
    assert_eq!(ready_on(&ev).get("ex-a"), Some(&7));

    let (ids, pages) = sandbox_pages(&mut sb, false, 3).await;
    assert_eq!(pages, 3);
    let (all_at_once, _) = sandbox_pages(&mut sb, false, 0).await;
    assert_eq!(ids, all_at_once);
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 7);

    let first = sn
        .list_snapshots(pb::ListSnapshotsRequest {
            page_size: 2,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(first.snapshots.len(), 2);
    let rest = sn
        .list_snapshots(pb::ListSnapshotsRequest {
            page_size: 2,
            page_token: first.next_page_token.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.snapshots.len(), 1);
    assert!(rest.next_page_token.is_empty());
    let executors = ex
        .list_executors(pb::ListExecutorsRequest {
            page_size: 1,
            page_token: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(executors.executors.len(), 1);
    assert!(executors.next_page_token.is_empty());

    // A token continues only the list (and filter) it came from; sizes are bounded.
    let e = sb
        .list_sandboxes(pb::ListSandboxesRequest {
            page_token: first.next_page_token.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = sb
        .list_sandboxes(pb::ListSandboxesRequest {
            page_size: 1001,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("page_size"), "{e:?}");

    // Two end; with all=true they are listed, until the retention passes.
    for id in &ids[..2] {
        sb.kill_sandbox(pb::KillSandboxRequest { id: id.clone() })
            .await
            .unwrap();
    }
    assert_eq!(sandbox_pages(&mut sb, true, 0).await.0.len(), 7);
    assert_eq!(sandbox_pages(&mut sb, false, 0).await.0.len(), 5);
    cp.shutdown().await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1500)).await;
    let mut cfg = config(dir.path(), &t);
    cfg.sandbox_timeouts.history_s = 1;
    let cp = server::start(cfg).await.unwrap();
    let (_, mut sb, _) = clients(cp.addr, Some(&t.admin)).await;
    let mut remembered = Vec::new();
    for _ in 0..50 {
        remembered = sandbox_pages(&mut sb, true, 0).await.0;
        if remembered.len() == 5 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(remembered, ids[2..].to_vec());
    cp.shutdown().await.unwrap();
}
