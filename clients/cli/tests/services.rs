//! The control plane and a real executor daemon on this machine's /dev/kvm, driven with the
//! `tine` CLI as a user would: errors reach the client with their gRPC code end to end (a
//! duplicate snapshot is ALREADY_EXISTS from the executor, a full cluster RESOURCE_EXHAUSTED,
//! an unknown sandbox NOT_FOUND), and children of a hand-made idle guest's snapshot are
//! spawned, listed and killed. `tine` itself is the VMM worker, as in production.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use std::path::Path;
use tine_control_plane::calls::Auth;

use tine_control_plane::db::{NewSnapshot, SnapshotLayers};
use tine_control_plane::server::{self, ServerConfig};
use tine_executor::daemon::{self, ExecutorConfig, RunningExecutor};
use tine_host::testing::{kvm_available, write_idle_guest_snapshot};
use tine_host::{HostConfig, Limits, Owner, Readiness, StoreConfig};
use tine_rpc::auth::{generate_token, Role, TokenEntry, TokenSet};
use tine_rpc::{ExecutorId, Tag};

const TINE: &str = env!("CARGO_BIN_EXE_tine");

fn run_tine(addr: &str, token: &str, args: &[String]) -> (Output, String) {
    let out = Command::new(TINE)
        .args(args)
        .env("TINE_ADDR", addr)
        .env("TINE_TOKEN", token)
        .output()
        .expect("run tine");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // What the user saw, for the test log (`--nocapture`).
    println!("$ tine {}\n{text}", args.join(" "));
    (out, text)
}

/// Kills an executor's VMs when a test ends, passing or not (its VMM workers outlive it).
struct KillOnDrop(std::sync::Arc<tine_executor::service::State>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        self.0.host.kill_all();
    }
}

struct Cluster {
    cp: server::RunningServer,
    addr: String,
    admin: String,
    executor_token: String,
}

async fn control_plane(dir: &Path) -> Cluster {
    let (admin, executor_token) = (generate_token(), generate_token());
    let cp = server::start(ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        db_path: dir.join("tine.db"),
        auth: Auth::Tokens(
            TokenSet::new(&[
                TokenEntry {
                    name: "admin".into(),
                    role: Role::Admin,
                    token: admin.clone(),
                },
                TokenEntry {
                    name: "executors".into(),
                    role: Role::Executor,
                    token: executor_token.clone(),
                },
            ])
            .unwrap(),
        ),
        audit_path: dir.join("audit.log"),
        metrics_listen: None,
        tls: None,
        executor_token: Some(executor_token.clone()),
        executor_tokens: Default::default(),
        executor_ca: None,
        heartbeat_interval_s: 1,
        lost_grace_ms: tine_control_plane::db::LOST_GRACE_MS,
        allow_plaintext_remote: false,
        sandbox_timeouts: Default::default(),
    })
    .await
    .unwrap();
    let addr = format!("http://{}", cp.addr);
    Cluster {
        cp,
        addr,
        admin,
        executor_token,
    }
}

impl Cluster {
    /// Run the `tine` CLI against this cluster as its admin (off the async threads).
    async fn tine(&self, args: &[&str]) -> (Output, String) {
        let (addr, admin) = (self.addr.clone(), self.admin.clone());
        let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        tokio::task::spawn_blocking(move || run_tine(&addr, &admin, &args))
            .await
            .unwrap()
    }

    /// Record snapshot `idle` of a hand-made guest as `executor`'s, as CreateSnapshot would.
    async fn record_snapshot(&self, executor: &str, layers: Option<SnapshotLayers>) {
        self.cp
            .ctx
            .db
            .insert_snapshot(&NewSnapshot {
                tag: "idle".into(),
                parent_tag: None,
                image: "hand-made".into(),
                vcpus: 1,
                mem_mib: 32,
                source_sandbox: None,
                executor_id: executor.into(),
                layers,
                state: tine_control_plane::db::NewState::Ready,
            })
            .await
            .unwrap();
    }
}

/// An executor daemon on this host's /dev/kvm with its own data directory, registered with
/// the cluster's control plane.
async fn executor(
    c: &Cluster,
    id: &str,
    data: &Path,
    max_vms: u32,
    store: Option<&Path>,
) -> RunningExecutor {
    let id = ExecutorId::parse(id).unwrap();
    let ex = daemon::start(ExecutorConfig {
        id: id.clone(),
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: None,
        token: Some(c.executor_token.clone()),
        control_plane: Some(c.addr.clone()),
        control_plane_ca: None,
        tls: None,
        host: HostConfig {
            data_dir: data.to_path_buf(),
            image_cache: data.join("images"),
            worker_exe: TINE.into(),
            owner: Owner::executor(&id),
            readiness: Readiness::Running,
            limits: Limits {
                max_vms,
                pool_size: 1,
                pool_max: 1,
                ..Limits::default()
            },
            store: store.map(|s| StoreConfig {
                url: s.display().to_string(),
                layer_cache: data.join("layers"),
                fetch: tine_host::FetchMode::Eager,
                cache_max_bytes: None,
                gc_grace: tine_host::DEFAULT_GC_GRACE,
            }),
            network: None,
            cgroups: tine_host::CgroupMode::Off,
            confine: tine_host::Confinement::default(),
        },
        metrics_listen: None,
        allow_plaintext_remote: false,
        vm_refusal: None,
    })
    .await
    .unwrap();
    let t0 = Instant::now();
    while !c
        .cp
        .ctx
        .db
        .executors()
        .await
        .unwrap()
        .iter()
        .any(|e| e.id == id.as_str())
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "{id} never registered"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    ex
}

fn kvm() -> bool {
    let ok = kvm_available();
    if !ok {
        eprintln!("SKIPPED: /dev/kvm is absent or not usable");
    }
    ok
}

/// A data directory holding the idle guest's snapshot under tag `idle`.
fn data_with_snapshot(data: &Path) {
    let snap = data.join("snapshots").join("idle");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    write_idle_guest_snapshot(&snap, 32).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_keep_their_codes_through_the_control_plane() {
    if !kvm() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("executor");
    data_with_snapshot(&data);
    let c = control_plane(tmp.path()).await;
    let ex = executor(&c, "kvm-1", &data, 2, None).await;
    let _cleanup = KillOnDrop(ex.state.clone());

    // The executor already holds `idle`: its ALREADY_EXISTS reaches the CLI.
    let (out, text) = c
        .tine(&[
            "snapshots",
            "create",
            "--tag",
            "idle",
            "--image",
            "busybox",
            "--executor",
            "kvm-1",
        ])
        .await;
    assert!(!out.status.success());
    assert!(text.contains("ALREADY_EXISTS"), "{text}");
    assert!(text.contains("snapshot idle already exists"), "{text}");

    c.record_snapshot("kvm-1", None).await;

    // Three children on a cluster with two slots: two real VMs, one RESOURCE_EXHAUSTED.
    let (out, text) = c
        .tine(&["sandbox", "spawn", "--tag", "idle", "-n", "3"])
        .await;
    assert!(!out.status.success(), "a failed child fails the command");
    assert_eq!(text.matches(" ready in ").count(), 2, "{text}");
    assert!(text.contains("FAILED (RESOURCE_EXHAUSTED)"), "{text}");
    assert_eq!(ex.state.host.live_ids().len(), 2);

    // An unknown sandbox is NOT_FOUND; killing a real one stops its VM.
    let (out, text) = c.tine(&["sandbox", "kill", "sbx-0000000000000000"]).await;
    assert!(!out.status.success());
    assert!(text.contains("NOT_FOUND"), "{text}");
    let victim = ex.state.host.live_ids()[0].to_string();
    let (out, text) = c.tine(&["sandbox", "kill", &victim]).await;
    assert!(out.status.success(), "{text}");
    assert_eq!(ex.state.host.live_ids().len(), 1);

    ex.shutdown(true).await.unwrap();
    c.cp.shutdown().await.unwrap();
}

/// Two executors standing for two hosts that share only the store: a snapshot made on A is
/// spawned on both; B fetches it (its layers verified) and runs real children; the control
/// plane reports the snapshot's digests and sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executor_without_the_snapshot_fetches_it_from_the_store() {
    if !kvm() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("store");
    let (a_data, b_data) = (tmp.path().join("a"), tmp.path().join("b"));
    data_with_snapshot(&a_data);
    let c = control_plane(tmp.path()).await;
    let a = executor(&c, "host-a", &a_data, 4, Some(&store)).await;
    let b = executor(&c, "host-b", &b_data, 4, Some(&store)).await;
    let _cleanup = (KillOnDrop(a.state.clone()), KillOnDrop(b.state.clone()));
    // What CreateSnapshot on A records (the snapshot itself is a hand-made guest's).
    let st = a.state.clone();
    let info = tokio::task::spawn_blocking(move || st.host.publish(&Tag::parse("idle").unwrap()))
        .await
        .unwrap()
        .unwrap();
    c.record_snapshot(
        "host-a",
        Some(SnapshotLayers {
            head_digest: info.head.to_string(),
            parent_digest: None,
            chain: info.chain.iter().map(|d| d.to_string()).collect(),
            memory_bytes: info.memory_bytes,
            stored_bytes: info.raw_bytes,
            compressed_bytes: info.stored_bytes,
        }),
    )
    .await;
    let (out, text) = c
        .tine(&["sandbox", "spawn", "--tag", "idle", "-n", "4"])
        .await;
    assert!(out.status.success(), "{text}");
    // Equal free slots: B gets a child once A is FETCH_COST_SLOTS fuller (3 + 1 of 4).
    assert_eq!(text.matches("on host-a").count(), 3, "{text}");
    assert_eq!(text.matches("on host-b").count(), 1, "{text}");
    assert_eq!(b.state.host.live_ids().len(), 1);
    assert!(b_data.join("snapshots/idle/snapshot.json").is_file());

    let (out, text) = c.tine(&["snapshots", "get", "idle"]).await;
    assert!(out.status.success(), "{text}");
    assert!(text.contains(&info.head.to_string()), "{text}");
    assert!(text.contains("memory 32.0 MiB"), "{text}");
    a.shutdown(true).await.unwrap();
    b.shutdown(true).await.unwrap();
    c.cp.shutdown().await.unwrap();
}
