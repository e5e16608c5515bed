//! The executor daemon over real loopback gRPC on this machine's /dev/kvm, with a hand-made
//! idle guest's snapshot: spawn with per-child codes (a full executor answers
//! RESOURCE_EXHAUSTED), typed errors for unknown and duplicate things, auth, the spawn-phase
//! metrics, and re-adoption across a daemon restart.
//!
//! Its own main (harness = false): started as `daemon __vmm-worker`, this binary is the VMM
//! worker, as `tine __vmm-worker` is in production.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use tine_executor::daemon::{self, ExecutorConfig, RunningExecutor};
use tine_host::testing::{kvm_available, write_idle_guest_snapshot};
use tine_host::{HostConfig, Limits, Owner, Readiness, WORKER_SUBCOMMAND};
use tine_proto::executor::v1 as xpb;
use tine_proto::executor::v1::executor_client::ExecutorClient;
use tine_proto::v1 as pb;
use tine_rpc::auth::{generate_token, Bearer};
use tine_rpc::ExecutorId;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::Code;

type Client = ExecutorClient<InterceptedService<Channel, Bearer>>;

async fn start(data: &Path, token: &str, max_vms: u32) -> RunningExecutor {
    let id = ExecutorId::parse("test-exec").unwrap();
    daemon::start(ExecutorConfig {
        id: id.clone(),
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: None,
        token: Some(token.to_string()),
        control_plane: None,
        control_plane_ca: None,
        tls: None,
        host: HostConfig {
            data_dir: data.to_path_buf(),
            image_cache: data.join("images"),
            worker_exe: std::env::current_exe().unwrap(),
            owner: Owner::executor(&id),
            readiness: Readiness::Running,
            limits: Limits {
                max_vms,
                pool_size: 1,
                pool_max: 1,
                ready_timeout: Duration::from_secs(60),
                ..Limits::default()
            },
            store: None,
            network: None,
            cgroups: tine_host::CgroupMode::Off,
            confine: tine_host::Confinement::default(),
        },
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        allow_plaintext_remote: false,
        vm_refusal: None,
    })
    .await
    .unwrap()
}

async fn client(addr: SocketAddr, token: Option<&str>) -> Client {
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    ExecutorClient::with_interceptor(ch, Bearer::new(token).unwrap())
}

fn spawn_request(tag: &str, ids: &[&str]) -> xpb::SpawnRequest {
    xpb::SpawnRequest {
        tag: tag.into(),
        ids: ids.iter().map(|s| s.to_string()).collect(),
        resources: None,
        ready_timeout_ms: 0,
        head_digest: String::new(),
        network: None,
    }
}

async fn spawn(c: &mut Client, tag: &str, ids: &[&str]) -> Vec<xpb::SpawnEvent> {
    let mut s = c.spawn(spawn_request(tag, ids)).await.unwrap().into_inner();
    let mut out = Vec::new();
    while let Some(ev) = s.message().await.unwrap() {
        out.push(ev);
    }
    out
}

async fn metrics(addr: SocketAddr) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    out
}

async fn executor_api_end_to_end() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = tmp.path().join("snapshots").join("idle");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    write_idle_guest_snapshot(&snap, 32).unwrap();
    let token = generate_token();
    let ex = start(tmp.path(), &token, 2).await;
    let mut c = client(ex.addr, Some(&token)).await;

    // Auth first: no token, no service.
    let mut anon = client(ex.addr, None).await;
    let e = anon.info(xpb::InfoRequest {}).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);

    // A parent's shape and image are checked here as well as at the control plane: no more
    // RAM than the bounds (or this host), images from the image store only.
    for (image, mem_mib, field) in [
        ("busybox", 1u64 << 40, "mem_mib"),
        ("busybox", 8, "mem_mib"),
        ("../../etc", 0, "image"),
        ("/tmp", 0, "image"),
    ] {
        let e = c
            .create_snapshot(pb::CreateSnapshotRequest {
                tag: "shape".into(),
                image: image.into(),
                mem_mib,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{image} {mem_mib}: {e:?}");
        assert!(e.message().contains(field), "{e:?}");
    }

    // Three children on a two-slot executor: two ready, one RESOURCE_EXHAUSTED with the reason.
    // The third comes in a call of its own: children of one call race for the slots, and the
    // rest of this test needs sbx-a1 and sbx-a2 to be the ones running.
    let mut events = spawn(&mut c, "idle", &["sbx-a1", "sbx-a2"]).await;
    events.extend(spawn(&mut c, "idle", &["sbx-a3"]).await);
    assert_eq!(events.len(), 3);
    let mut ready = 0;
    let mut full = Vec::new();
    for ev in &events {
        match ev.result.as_ref().unwrap() {
            xpb::spawn_event::Result::ReadyUs(us) => {
                assert!(*us > 0);
                ready += 1;
            }
            xpb::spawn_event::Result::Failure(e) => full.push(e.clone()),
            xpb::spawn_event::Result::Error(m) => panic!("an untyped error: {m}"),
        }
    }
    assert_eq!(ready, 2);
    assert_eq!(full.len(), 1);
    assert_eq!(
        Code::from_i32(full[0].code),
        Code::ResourceExhausted,
        "{full:?}"
    );
    assert!(full[0].message.contains("full"), "{full:?}");
    let info = c.info(xpb::InfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.live_sandboxes.len(), 2);
    assert_eq!(info.cached_tags, vec!["idle".to_string()]);

    // Typed errors for unknown, duplicate and hostile things.
    let e = c
        .spawn(spawn_request("nope", &["sbx-b1"]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let e = c
        .spawn(spawn_request("../etc", &["sbx-b1"]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    let e = c
        .create_snapshot(pb::CreateSnapshotRequest {
            tag: "idle".into(),
            image: "busybox".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    let e = c
        .eval(pb::EvalRequest {
            sandbox_id: "sbx-nope".into(),
            code: "1".into(),
            timeout_ms: 0,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound, "{e:?}");
    let killed = c
        .kill(xpb::KillRequest {
            id: "sbx-nope".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!killed.existed);

    // The phase histograms counted the two ready children.
    let text = metrics(ex.metrics_addr.unwrap()).await;
    for phase in ["handoff", "restore", "running", "total"] {
        let line = format!("tine_executor_spawn_phase_seconds_count{{phase=\"{phase}\"}} 2");
        assert!(text.contains(&line), "{line} missing from:\n{text}");
    }
    assert!(
        text.contains("tine_executor_spawn_failures_total{reason=\"full\"} 1"),
        "{text}"
    );
    // Readiness here does not wait for an agent (hand-made guests): no retries to count.
    assert!(
        text.contains("tine_executor_spawn_agent_retries_total 0"),
        "{text}"
    );

    // Branch a running child: the branch is a child of its snapshot, made from that sandbox,
    // and spawnable here once a slot is free.
    let b = c
        .branch(pb::BranchRequest {
            sandbox_id: "sbx-a1".into(),
            tag: "idle-b1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (b.parent_tag.as_str(), b.source_sandbox.as_str()),
        ("idle", "sbx-a1")
    );
    let info = b.branch.unwrap();
    assert_eq!(info.mode, pb::BranchMode::Diff as i32);
    assert!(
        info.pause_us > 0 && info.pause_us <= info.took_us,
        "{info:?}"
    );
    // Live: a diff too, copied after the child resumed.
    let live = c
        .branch(pb::BranchRequest {
            sandbox_id: "sbx-a1".into(),
            tag: "idle-live".into(),
            mode: pb::BranchMode::Live as i32,
            no_wait: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(live.branch.unwrap().mode, pb::BranchMode::Live as i32);
    // The child was rebased onto its first branch (which may hold no page at all: this
    // guest idles), so the next one is a diff over that.
    assert_eq!(live.parent_tag, "idle-b1");
    // The unary call answers only with the finished snapshot, so it refuses no_wait ...
    let e = c
        .branch(pb::BranchRequest {
            sandbox_id: "sbx-a1".into(),
            tag: "idle-b2".into(),
            mode: pb::BranchMode::Diff as i32,
            no_wait: true,
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    // ... and StartBranch reports the resume first, then the snapshot.
    for (tag, mode, parent) in [
        ("idle-s-live", pb::BranchMode::Live, "idle-live"),
        ("idle-s-diff", pb::BranchMode::Diff, "idle-s-live"),
    ] {
        let mut events = c
            .start_branch(pb::BranchRequest {
                sandbox_id: "sbx-a1".into(),
                tag: tag.into(),
                mode: mode as i32,
                no_wait: true,
            })
            .await
            .unwrap()
            .into_inner();
        let mut got = Vec::new();
        while let Some(ev) = events.message().await.unwrap() {
            got.push(ev.event.unwrap());
        }
        let [xpb::branch_event::Event::Resumed(r), xpb::branch_event::Event::Done(d)] = &got[..]
        else {
            panic!("{mode:?}: {got:?}")
        };
        let info = d.branch.unwrap();
        assert_eq!(r.pause_us, info.pause_us, "{mode:?}");
        assert_eq!(r.parent_tag, parent);
        assert_eq!((d.tag.as_str(), d.parent_tag.as_str()), (tag, parent));
        assert_eq!(d.state(), pb::SnapshotState::Ready);
    }
    // A branch that fails ends the stream with the error.
    let mut events = c
        .start_branch(pb::BranchRequest {
            sandbox_id: "sbx-a1".into(),
            tag: "idle-s-live".into(),
            mode: pb::BranchMode::Live as i32,
            no_wait: true,
        })
        .await
        .unwrap()
        .into_inner();
    let e = events.message().await.unwrap_err();
    assert_eq!(e.code(), Code::AlreadyExists, "{e:?}");
    for (req, code) in [
        (
            ("sbx-nope", "idle-b2", pb::BranchMode::Diff),
            Code::NotFound,
        ),
        (
            ("sbx-a1", "idle-b1", pb::BranchMode::Diff),
            Code::AlreadyExists,
        ),
        (
            ("sbx-a1", "../x", pb::BranchMode::Diff),
            Code::InvalidArgument,
        ),
    ] {
        let e = c
            .branch(pb::BranchRequest {
                sandbox_id: req.0.into(),
                tag: req.1.into(),
                mode: req.2 as i32,
                no_wait: false,
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), code, "{req:?}: {e:?}");
    }
    let e = c
        .delete_snapshot(xpb::DeleteSnapshotRequest { tag: "idle".into() })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        c.kill(xpb::KillRequest {
            id: "sbx-a2".into()
        })
        .await
        .unwrap()
        .into_inner()
        .existed
    );
    let events = spawn(&mut c, "idle-b1", &["sbx-a2"]).await;
    assert!(
        matches!(events[0].result, Some(xpb::spawn_event::Result::ReadyUs(_))),
        "{events:?}"
    );

    // Restart without killing: the new daemon re-adopts both children.
    ex.shutdown(false).await.unwrap();
    let ex = start(tmp.path(), &token, 2).await;
    let mut c = client(ex.addr, Some(&token)).await;
    let info = c.info(xpb::InfoRequest {}).await.unwrap().into_inner();
    let mut live = info.live_sandboxes.clone();
    live.sort();
    assert_eq!(live, vec!["sbx-a1".to_string(), "sbx-a2".to_string()]);
    for id in live {
        let k = c.kill(xpb::KillRequest { id }).await.unwrap().into_inner();
        assert!(k.existed);
    }
    let info = c.info(xpb::InfoRequest {}).await.unwrap().into_inner();
    assert!(info.live_sandboxes.is_empty());
    ex.shutdown(true).await.unwrap();
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(WORKER_SUBCOMMAND) {
        let code = tine_host::worker_main().unwrap_or_else(|e| {
            eprintln!("worker: {e:#}");
            1
        });
        std::process::exit(code);
    }
    if !kvm_available() {
        println!("SKIPPED: /dev/kvm is absent or not usable; the daemon tests need KVM");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(executor_api_end_to_end());
    println!("test executor_api_end_to_end ... ok");
}
