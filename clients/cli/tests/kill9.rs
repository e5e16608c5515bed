//! The kill -9 matrix (#15), without the lab: `tine control-plane` and `tine executor` run as
//! real processes (the executor on this machine's /dev/kvm, children of a hand-made guest's
//! snapshot, `--readiness running`), and each is killed with SIGKILL in the middle of a
//! spawn, the control plane also in the middle of deletes, then restarted on the same state.
//! After every restart:
//! - every child is accounted for: listed READY by the control plane and running on the
//!   executor (re-adopted), or ended (FAILED / LOST) with a reason; none runs that the control
//!   plane does not list, none stays STARTING;
//! - the spawn that was cut short reported each of its children (ready or failed) or failed
//!   as a whole with the reason (no child silently dropped);
//! - no lineage row is lost or half-deleted (a child snapshot never outlives its parent);
//! - the audit log holds whole lines only.
//!
//! What needs a bootable guest (kill -9 mid-snapshot, mid-push of a real snapshot) is the lab's.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tine_control_plane::db::{Db, ExecutorReport, NewSnapshot, NewState};
use tine_host::testing::{kvm_available, write_idle_guest_snapshot};
use tine_proto::executor::v1 as xpb;
use tine_proto::executor::v1::executor_client::ExecutorClient;
use tine_proto::v1 as pb;
use tine_proto::v1::sandboxes_client::SandboxesClient;
use tine_proto::v1::snapshots_client::SnapshotsClient;
use tine_rpc::auth::{generate_token, write_private_file, write_tokens_file, Bearer};
use tine_rpc::auth::{Role, TokenEntry, TokensFile};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

const TINE: &str = env!("CARGO_BIN_EXE_tine");

type Svc = InterceptedService<Channel, Bearer>;

fn free_port() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// A service process that is killed (SIGKILL) when dropped.
struct Proc {
    name: &'static str,
    child: Child,
}

impl Proc {
    fn start(name: &'static str, args: &[String], log: &Path) -> Proc {
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let child = Command::new(TINE)
            .args(args)
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        Proc { name, child }
    }

    fn kill9(&mut self) {
        // SIGKILL: no handler, no cleanup, mid-write whatever it was doing.
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        println!("     killed {} with SIGKILL", self.name);
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Cluster {
    dir: PathBuf,
    cp_listen: SocketAddr,
    ex_listen: SocketAddr,
    admin: String,
    executor_token: String,
    cp: Option<Proc>,
    ex: Option<Proc>,
}

impl Cluster {
    fn cp_args(&self) -> Vec<String> {
        let d = &self.dir;
        [
            "control-plane",
            "--listen",
            &self.cp_listen.to_string(),
            "--db",
            &d.join("tine.db").display().to_string(),
            "--tokens",
            &d.join("tokens.json").display().to_string(),
            "--audit-log",
            &d.join("audit.log").display().to_string(),
            "--heartbeat-interval-s",
            "1",
            "--lost-grace-secs",
            "1",
        ]
        .map(String::from)
        .to_vec()
    }

    fn ex_args(&self) -> Vec<String> {
        let d = &self.dir;
        [
            "executor",
            "--id",
            "ex-a",
            "--data-dir",
            &d.join("data").display().to_string(),
            "--listen",
            &self.ex_listen.to_string(),
            "--metrics-listen",
            &free_port().to_string(),
            "--control-plane",
            &format!("http://{}", self.cp_listen),
            "--token-file",
            &d.join("executor.token").display().to_string(),
            "--max-sandboxes",
            "16",
            "--pool",
            "2",
            "--cgroup",
            "off",
            "--allow-pvm",
            "--no-network",
            "--readiness",
            "running",
        ]
        .map(String::from)
        .to_vec()
    }

    fn start_cp(&mut self) {
        self.cp = Some(Proc::start(
            "the control plane",
            &self.cp_args(),
            &self.dir.join("cp.log"),
        ));
    }

    fn start_ex(&mut self) {
        self.ex = Some(Proc::start(
            "the executor",
            &self.ex_args(),
            &self.dir.join("ex.log"),
        ));
    }

    async fn channel(addr: SocketAddr) -> Channel {
        Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_timeout(Duration::from_secs(2))
            .connect_lazy()
    }

    async fn sandboxes(&self) -> SandboxesClient<Svc> {
        SandboxesClient::with_interceptor(
            Self::channel(self.cp_listen).await,
            Bearer::new(Some(&self.admin)).unwrap(),
        )
    }

    async fn snapshots(&self) -> SnapshotsClient<Svc> {
        SnapshotsClient::with_interceptor(
            Self::channel(self.cp_listen).await,
            Bearer::new(Some(&self.admin)).unwrap(),
        )
    }

    /// The executor's own view (as the control plane calls it, with its token).
    async fn executor_live(&self) -> Option<BTreeSet<String>> {
        let mut c = ExecutorClient::with_interceptor(
            Self::channel(self.ex_listen).await,
            Bearer::new(Some(&self.executor_token)).unwrap(),
        );
        let info = c.info(xpb::InfoRequest {}).await.ok()?.into_inner();
        Some(info.live_sandboxes.into_iter().collect())
    }

    /// Wait until the control plane lists executor ex-a as up, at its address with its
    /// capacity (not the fixture's row), and the executor answers.
    async fn until_registered(&self) {
        let t0 = Instant::now();
        loop {
            let mut c = tine_proto::v1::executors_client::ExecutorsClient::with_interceptor(
                Self::channel(self.cp_listen).await,
                Bearer::new(Some(&self.admin)).unwrap(),
            );
            if let Ok(r) = c.list_executors(pb::ListExecutorsRequest::default()).await {
                let addr = format!("http://{}", self.ex_listen);
                let up = r.into_inner().executors.iter().any(|e| {
                    e.id == "ex-a"
                        && e.state == pb::ExecutorState::Up as i32
                        && e.addr == addr
                        && e.capacity.as_ref().is_some_and(|c| c.max_sandboxes == 16)
                });
                if up && self.executor_live().await.is_some() {
                    return;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "ex-a never registered; logs in {}",
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn all_sandboxes(&self) -> Vec<pb::Sandbox> {
        let mut sb = self.sandboxes().await;
        sb.list_sandboxes(pb::ListSandboxesRequest {
            all: true,
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes
    }

    /// Wait until the control plane and the executor agree: every child the control plane
    /// lists READY runs on the executor and nothing else does, none is STARTING, and every
    /// ended one says why. Returns the ready ones.
    async fn until_consistent(&self, what: &str) -> BTreeSet<String> {
        let t0 = Instant::now();
        loop {
            let listed = self.all_sandboxes().await;
            let ready: BTreeSet<String> = listed
                .iter()
                .filter(|s| s.state == pb::SandboxState::Ready as i32)
                .map(|s| s.id.clone())
                .collect();
            let starting = listed
                .iter()
                .filter(|s| s.state == pb::SandboxState::Starting as i32)
                .count();
            let live = self.executor_live().await;
            if starting == 0 && live.as_ref() == Some(&ready) {
                for s in &listed {
                    let ended = [pb::SandboxState::Failed, pb::SandboxState::Lost]
                        .map(|st| st as i32)
                        .contains(&s.state);
                    assert!(
                        !ended || !s.error.is_empty(),
                        "{what}: {s:?} ended silently"
                    );
                }
                let states: Vec<String> = listed
                    .iter()
                    .map(|s| {
                        format!(
                            "{} {}",
                            s.id,
                            pb::SandboxState::try_from(s.state)
                                .map(|s| s.as_str_name())
                                .unwrap_or("?")
                        )
                    })
                    .collect();
                println!(
                    "     {what}: consistent after {:?}: {states:?}",
                    t0.elapsed()
                );
                return ready;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{what}: never consistent: {starting} starting, ready {ready:?}, executor runs {live:?}; logs in {}",
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Spawn `n` children and SIGKILL `victim` once the first is ready. Returns the events
    /// the stream delivered and how it ended.
    async fn spawn_and_kill(&mut self, n: u32, victim: &str) -> (Vec<pb::SpawnEvent>, String) {
        let mut sb = self.sandboxes().await;
        let mut stream = sb
            .spawn(pb::SpawnRequest {
                tag: "idle".into(),
                count: n,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let mut events = Vec::new();
        let end = loop {
            match stream.message().await {
                Ok(Some(ev)) => {
                    let first = events.is_empty();
                    events.push(ev);
                    if first {
                        match victim {
                            "executor" => self.ex.as_mut().unwrap().kill9(),
                            _ => self.cp.as_mut().unwrap().kill9(),
                        }
                    }
                }
                Ok(None) => break "ended".to_string(),
                Err(s) => break format!("{:?}: {}", s.code(), s.message()),
            }
        };
        (events, end)
    }
}

impl Drop for Cluster {
    /// Whatever happened, no VM of this test outlives it: the services go first, then the
    /// executor's children (their VMMs outlive a killed executor by design) are killed as a
    /// restarted executor would find them.
    fn drop(&mut self) {
        drop(self.ex.take());
        drop(self.cp.take());
        let id = tine_rpc::ExecutorId::parse("ex-a").unwrap();
        let data = self.dir.join("data");
        let host = tine_host::Host::open_exclusive(tine_host::HostConfig {
            data_dir: data.clone(),
            image_cache: data.join("images"),
            worker_exe: TINE.into(),
            owner: tine_host::Owner::executor(&id),
            readiness: tine_host::Readiness::Running,
            limits: tine_host::Limits {
                pool_size: 0,
                ..tine_host::Limits::default()
            },
            store: None,
            network: None,
            cgroups: tine_host::CgroupMode::Off,
            confine: tine_host::Confinement::default(),
        });
        match host {
            Ok(h) => h.kill_all(),
            Err(e) => eprintln!("cleaning up {}: {e}", data.display()),
        }
    }
}

fn audit_is_whole(dir: &Path) {
    let text = std::fs::read_to_string(dir.join("audit.log")).unwrap();
    for line in text.lines() {
        serde_json::from_str::<serde_json::Value>(line)
            .unwrap_or_else(|e| panic!("a torn audit line {line:?}: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_killed_mid_operation_come_back_consistent() {
    if !kvm_available() {
        eprintln!("SKIPPED: /dev/kvm is absent or not usable");
        return;
    }
    // The services' logs stay for a look when TINE_TEST_KEEP is set.
    let tmp = tempfile::tempdir().unwrap();
    let (dir, _tmp) = match std::env::var_os("TINE_TEST_KEEP") {
        Some(_) => (tmp.keep(), None),
        None => (tmp.path().to_path_buf(), Some(tmp)),
    };
    let snap = dir.join("data/snapshots/idle");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    write_idle_guest_snapshot(&snap, 32).unwrap();
    let (admin, executor_token) = (generate_token(), generate_token());
    write_tokens_file(
        &dir.join("tokens.json"),
        &TokensFile {
            tokens: vec![
                TokenEntry {
                    name: "admin".into(),
                    role: Role::Admin,
                    token: admin.clone(),
                },
                TokenEntry {
                    name: "executor:ex-a".into(),
                    role: Role::Executor,
                    token: executor_token.clone(),
                },
            ],
        },
    )
    .unwrap();
    write_private_file(&dir.join("executor.token"), executor_token.as_bytes()).unwrap();
    // The snapshot rows CreateSnapshot would have written (the guest is hand-made): `idle`
    // on ex-a, and three parent/child pairs to delete.
    {
        let db = Db::open(&dir.join("tine.db")).await.unwrap();
        db.upsert_executor(
            "ex-a",
            "http://127.0.0.1:1",
            &ExecutorReport::default(),
            "executor:ex-a",
        )
        .await
        .unwrap();
        let row = |tag: &str, parent: Option<&str>| NewSnapshot {
            tag: tag.into(),
            parent_tag: parent.map(str::to_owned),
            image: "hand-made".into(),
            vcpus: 1,
            mem_mib: 32,
            source_sandbox: None,
            executor_id: "ex-a".into(),
            layers: None,
            state: NewState::Ready,
        };
        db.insert_snapshot(&row("idle", None)).await.unwrap();
        for i in 0..3 {
            db.insert_snapshot(&row(&format!("base-{i}"), None))
                .await
                .unwrap();
            db.insert_snapshot(&row(&format!("leaf-{i}"), Some(&format!("base-{i}"))))
                .await
                .unwrap();
        }
        db.close().await;
    }
    let mut c = Cluster {
        dir: dir.clone(),
        cp_listen: free_port(),
        ex_listen: free_port(),
        admin,
        executor_token,
        cp: None,
        ex: None,
    };
    c.start_cp();
    c.start_ex();
    c.until_registered().await;

    // 1. The executor dies while it spawns: the spawn reports what it can, the restarted
    //    executor re-adopts the children it had made ready.
    println!("  -- kill -9 the executor mid-spawn");
    let (events, end) = c.spawn_and_kill(6, "executor").await;
    println!("     the spawn saw {} events, then {end}", events.len());
    assert!(!events.is_empty());
    let reported = events.len() == 6 || end != "ended";
    assert!(
        reported,
        "a spawn dropped children silently: {events:?} {end}"
    );
    c.start_ex();
    c.until_registered().await;
    let ready = c.until_consistent("after the executor's restart").await;
    // The child it reported ready before it died (the kill came right after) was re-adopted.
    match &events[0].result {
        Some(pb::spawn_event::Result::Ready(s)) => {
            assert!(
                ready.contains(&s.id),
                "{} was ready, then not re-adopted",
                s.id
            )
        }
        other => println!("     (the first event was not a ready child: {other:?})"),
    }

    // 2. The control plane dies while it spawns: restarted on the same database, it and the
    //    executor converge (children it never recorded as ready are killed or reported).
    println!("  -- kill -9 the control plane mid-spawn");
    let (events, end) = c.spawn_and_kill(6, "control plane").await;
    println!("     the spawn saw {} events, then {end}", events.len());
    // The stream ends cleanly only if the control plane had sent every child before the
    // signal landed (a fast host can spawn six tiny guests first); otherwise it breaks.
    assert!(
        events.len() == 6 || end != "ended",
        "the stream ended cleanly ({end}) without its server, missing children: {events:?}"
    );
    c.start_cp();
    c.until_registered().await;
    let ready = c
        .until_consistent("after the control plane's restart")
        .await;
    audit_is_whole(&dir);

    // 3. The control plane dies during cascading deletes: each pair is there whole or gone
    //    whole, never a child without its parent.
    println!("  -- kill -9 the control plane mid-delete");
    for i in 0..3 {
        let mut sn = c.snapshots().await;
        let call = tokio::spawn(async move {
            sn.delete_snapshot(pb::DeleteSnapshotRequest {
                tag: format!("base-{i}"),
                cascade: true,
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(5 * i)).await;
        c.cp.as_mut().unwrap().kill9();
        let answered = call.await.unwrap();
        println!(
            "     delete base-{i}: {}",
            answered
                .as_ref()
                .map(|_| "answered".to_string())
                .unwrap_or_else(|s| format!("{:?}", s.code()))
        );
        c.start_cp();
        c.until_registered().await;
        let mut sn = c.snapshots().await;
        let tags: BTreeSet<String> = sn
            .list_snapshots(pb::ListSnapshotsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .snapshots
            .into_iter()
            .map(|s| s.tag)
            .collect();
        let (base, leaf) = (
            tags.contains(&format!("base-{i}")),
            tags.contains(&format!("leaf-{i}")),
        );
        assert_eq!(base, leaf, "base-{i} {base}, leaf-{i} {leaf}: {tags:?}");
        if answered.is_ok() {
            assert!(!base, "an answered delete left base-{i}");
        }
        assert!(tags.contains("idle"));
    }
    audit_is_whole(&dir);

    // The children still there are the control plane's to kill.
    let mut sb = c.sandboxes().await;
    for id in &ready {
        sb.kill_sandbox(pb::KillSandboxRequest { id: id.clone() })
            .await
            .unwrap();
    }
    assert_eq!(c.until_consistent("after killing the rest").await.len(), 0);
}
