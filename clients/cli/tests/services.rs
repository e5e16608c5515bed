//! The control plane and a real executor daemon on this machine's /dev/kvm, driven with the
//! `tine` CLI as a user would: errors reach the client with their gRPC code end to end (a
//! duplicate snapshot is ALREADY_EXISTS from the executor, a full cluster RESOURCE_EXHAUSTED,
//! an unknown sandbox NOT_FOUND), and children of a hand-made idle guest's snapshot are
//! spawned, listed and killed. `tine` itself is the VMM worker, as in production.

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tine_control_plane::calls::Auth;
use tine_control_plane::db::NewSnapshot;
use tine_control_plane::server::{self, ServerConfig};
use tine_executor::daemon::{self, ExecutorConfig};
use tine_host::testing::{kvm_available, write_idle_guest_snapshot};
use tine_host::{HostConfig, Limits, Owner, Readiness};
use tine_rpc::auth::{generate_token, Role, TokenEntry, TokenSet};
use tine_rpc::ExecutorId;

const TINE: &str = env!("CARGO_BIN_EXE_tine");

fn tine(addr: &str, token: &str, args: &[&str]) -> (Output, String) {
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_keep_their_codes_through_the_control_plane() {
    if !kvm_available() {
        eprintln!("SKIPPED: /dev/kvm is absent or not usable");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("executor");
    let snap = data.join("snapshots").join("idle");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    write_idle_guest_snapshot(&snap, 32).unwrap();

    let (admin, executor_token) = (generate_token(), generate_token());
    let cp = server::start(ServerConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        db_path: tmp.path().join("tine.db"),
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
        audit_path: tmp.path().join("audit.log"),
        metrics_listen: None,
        tls: None,
        executor_token: Some(executor_token.clone()),
        executor_ca: None,
        heartbeat_interval_s: 1,
        lost_grace_ms: tine_control_plane::db::LOST_GRACE_MS,
        allow_plaintext_remote: false,
    })
    .await
    .unwrap();
    let addr = format!("http://{}", cp.addr);
    let id = ExecutorId::parse("kvm-1").unwrap();
    let ex = daemon::start(ExecutorConfig {
        id: id.clone(),
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: None,
        token: Some(executor_token),
        control_plane: Some(addr.clone()),
        control_plane_ca: None,
        tls: None,
        host: HostConfig {
            data_dir: data.clone(),
            image_cache: tmp.path().join("images"),
            worker_exe: TINE.into(),
            owner: Owner::executor(&id),
            readiness: Readiness::Running,
            limits: Limits {
                max_vms: 2,
                pool_size: 1,
                ..Limits::default()
            },
        },
        metrics_listen: None,
        allow_plaintext_remote: false,
        vm_refusal: None,
    })
    .await
    .unwrap();
    // Wait for the executor to register.
    let t0 = Instant::now();
    while cp.ctx.db.executors().await.unwrap().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(20), "never registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let run = |args: &'static [&'static str]| {
        let (addr, admin) = (addr.clone(), admin.clone());
        tokio::task::spawn_blocking(move || tine(&addr, &admin, args))
    };

    // The executor already holds `idle`: its ALREADY_EXISTS reaches the CLI.
    let (out, text) = run(&[
        "snapshots",
        "create",
        "--tag",
        "idle",
        "--image",
        "busybox",
        "--executor",
        "kvm-1",
    ])
    .await
    .unwrap();
    assert!(!out.status.success());
    assert!(text.contains("ALREADY_EXISTS"), "{text}");
    assert!(text.contains("snapshot idle already exists"), "{text}");

    // Record the snapshot as the executor's, as CreateSnapshot would have.
    cp.ctx
        .db
        .insert_snapshot(&NewSnapshot {
            tag: "idle".into(),
            parent_tag: None,
            image: "hand-made".into(),
            vcpus: 1,
            mem_mib: 32,
            source_sandbox: None,
            executor_id: "kvm-1".into(),
        })
        .await
        .unwrap();

    // Three children on a cluster with two slots: two real VMs, one RESOURCE_EXHAUSTED.
    let (out, text) = run(&["sandbox", "spawn", "--tag", "idle", "-n", "3"])
        .await
        .unwrap();
    assert!(!out.status.success(), "a failed child fails the command");
    assert_eq!(text.matches(" ready in ").count(), 2, "{text}");
    assert!(text.contains("FAILED (RESOURCE_EXHAUSTED)"), "{text}");
    assert_eq!(ex.state.host.live_ids().len(), 2);

    // An unknown sandbox is NOT_FOUND; killing a real one stops its VM.
    let (out, text) = run(&["sandbox", "kill", "sbx-0000000000000000"])
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(text.contains("NOT_FOUND"), "{text}");
    let victim = ex.state.host.live_ids()[0].to_string();
    let (addr2, admin2) = (addr.clone(), admin.clone());
    let (out, text) =
        tokio::task::spawn_blocking(move || tine(&addr2, &admin2, &["sandbox", "kill", &victim]))
            .await
            .unwrap();
    assert!(out.status.success(), "{text}");
    assert_eq!(ex.state.host.live_ids().len(), 1);

    ex.shutdown(true).await.unwrap();
    cp.shutdown().await.unwrap();
}
