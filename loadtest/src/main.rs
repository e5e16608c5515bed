//! `tine-loadtest`: concurrent gRPC clients against a control plane.
//!
//! Without --addr it measures the control plane's own overhead: it starts one (real SQLite
//! file, real audit log, real auth) with null executors behind it (loopback gRPC servers that
//! do no VM work), so each latency is everything except an executor's work. By default that
//! control plane runs in this process; with --split (or --cp-cpus) in a process of its own,
//! optionally pinned to CPUs apart from the load's (see split.rs).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use tine_control_plane::calls::Auth;
use tine_control_plane::db::{ExecutorReport, NewSnapshot};
use tine_control_plane::server::{self, RunningServer, ServerConfig};
use tine_loadtest::null_executor;
use tine_loadtest::run::{run, Load};
use tine_loadtest::split::{self, ControlPlaneChild, CpuList};
use tine_rpc::auth::{generate_token, Role, TokenEntry, TokenSet};

#[derive(Parser)]
#[command(
    name = "tine-loadtest",
    about = "Spawn/exec/kill load against a Tine control plane"
)]
struct Args {
    /// Control plane to load (default: an in-process one with null executors).
    #[arg(long)]
    addr: Option<String>,
    /// File holding the token (with --addr; default: $TINE_TOKEN).
    #[arg(long, requires = "addr")]
    token_file: Option<PathBuf>,
    /// Snapshot to spawn from (with --addr; default `load`).
    #[arg(long, requires = "addr")]
    tag: Option<String>,
    /// Null executors behind the in-process control plane.
    #[arg(long, default_value_t = 3)]
    null_executors: usize,
    #[arg(long, default_value_t = 200)]
    clients: usize,
    #[arg(long, default_value_t = 8)]
    connections: usize,
    #[arg(long, default_value_t = 10)]
    duration_secs: u64,
    #[arg(long, default_value_t = 1)]
    children_per_spawn: u32,
    #[arg(long, default_value_t = 1)]
    execs_per_child: u32,
    /// Loops per second per client (0: back to back, measuring saturation throughput).
    #[arg(long, default_value_t = 10.0)]
    rate_per_client: f64,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run the in-process control plane in a process of its own instead (the clients and the
    /// null executors stay in this one).
    #[arg(long, conflicts_with = "addr")]
    split: bool,
    /// Pin the control-plane process to these CPUs (e.g. `0` or `0-1`); implies --split.
    #[arg(long, conflicts_with = "addr")]
    cp_cpus: Option<CpuList>,
    /// Pin this process to these CPUs: the clients and null executors, and the control plane
    /// too unless it runs apart (--split, --cp-cpus), where it keeps the CPUs allowed before.
    #[arg(long)]
    load_cpus: Option<CpuList>,
    /// Internal: be the control-plane process of --split.
    #[arg(long, hide = true)]
    serve_control_plane: bool,
    /// Internal: a null executor for --serve-control-plane to register.
    #[arg(long, hide = true)]
    null_executor_addr: Vec<String>,
}

fn main() -> Result<()> {
    let mut a = Args::parse();
    // Pin before the runtime exists, so its worker threads (and their count) follow the set.
    if a.serve_control_plane {
        if let Some(cpus) = &a.cp_cpus {
            split::pin(cpus)?;
        }
    } else if let Some(cpus) = &a.load_cpus {
        // A control plane apart runs where this process could before: name those CPUs, so
        // the child does not inherit the load's pinning unsaid.
        if a.split && a.cp_cpus.is_none() {
            a.cp_cpus = Some(split::allowed()?);
        }
        split::pin(cpus)?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if a.serve_control_plane {
        rt.block_on(serve_control_plane(&a))
    } else {
        rt.block_on(load(a))
    }
}

/// The snapshot the embedded control plane offers (and the default with --addr).
const LOAD_TAG: &str = "load";

/// The id of null executor `i`.
fn null_executor_id(i: usize) -> String {
    format!("null-{i}")
}

/// The control plane the load runs against when no --addr is given, behind `null_executors`
/// (their gRPC addresses); returns it with a user token for the clients.
async fn embedded_control_plane(
    dir: &std::path::Path,
    null_executors: &[String],
) -> Result<(RunningServer, String)> {
    let (user, exec) = (generate_token(), generate_token());
    let cp = server::start(ServerConfig {
        listen: "127.0.0.1:0".parse()?,
        db_path: dir.join("tine.db"),
        auth: Auth::Tokens(TokenSet::new(&[
            TokenEntry {
                name: "load".into(),
                role: Role::User,
                token: user.clone(),
            },
            TokenEntry {
                name: "executors".into(),
                role: Role::Executor,
                token: exec.clone(),
            },
        ])?),
        audit_path: dir.join("audit.log"),
        metrics_listen: None,
        tls: None,
        executor_token: Some(exec),
        executor_tokens: Default::default(),
        executor_ca: None,
        heartbeat_interval_s: 5,
        lost_grace_ms: tine_control_plane::db::LOST_GRACE_MS,
        allow_plaintext_remote: false,
        sandbox_timeouts: Default::default(),
    })
    .await?;
    let report = ExecutorReport {
        max_sandboxes: 1_000_000,
        cached_tags: vec![LOAD_TAG.into()],
        ..Default::default()
    };
    for (i, ex) in null_executors.iter().enumerate() {
        cp.ctx
            .db
            .upsert_executor(&null_executor_id(i), ex, &report, "loadtest")
            .await?;
        if i == 0 {
            cp.ctx
                .db
                .insert_snapshot(&NewSnapshot {
                    tag: LOAD_TAG.into(),
                    parent_tag: None,
                    image: "none".into(),
                    vcpus: 1,
                    mem_mib: 0,
                    source_sandbox: None,
                    executor_id: null_executor_id(0),
                    layers: None,
                    state: tine_control_plane::db::NewState::Ready,
                })
                .await?;
        }
    }
    for i in 0..null_executors.len() {
        cp.ctx
            .db
            .heartbeat(&null_executor_id(i), &report, "loadtest")
            .await?;
    }
    // Keep the null executors "up" (heartbeats within three periods) for the whole run.
    let db = cp.ctx.db.clone();
    let n = null_executors.len();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(2)).await;
            for i in 0..n {
                let _ = db
                    .heartbeat(&null_executor_id(i), &report, "loadtest")
                    .await;
            }
        }
    });
    Ok((cp, user))
}

/// The control plane's own counters for the report: phase table text and JSON fields.
fn control_plane_report(cp: &RunningServer) -> serde_json::Value {
    let phases = cp.ctx.metrics.spawn_phases();
    serde_json::json!({
        "table": tine_loadtest::report::phase_table(&phases),
        "spawn_phases": tine_loadtest::report::phase_json(&phases),
        "write_lock_waits": tine_control_plane::lock_wait::waits(),
        "inline_busy_fallbacks": tine_control_plane::db::inline_fallbacks(),
    })
}

async fn serve_control_plane(a: &Args) -> Result<()> {
    if a.null_executor_addr.is_empty() {
        anyhow::bail!("--serve-control-plane needs at least one --null-executor-addr");
    }
    let dir = tempfile::tempdir()?;
    let (cp, token) = embedded_control_plane(dir.path(), &a.null_executor_addr).await?;
    split::tell_parent(
        &serde_json::json!({"addr": format!("http://{}", cp.addr), "token": token}),
    )?;
    split::until_stdin_closes().await;
    split::tell_parent(&control_plane_report(&cp))?;
    cp.shutdown().await?;
    Ok(())
}

async fn null_executors(n: usize) -> Result<Vec<String>> {
    let mut addrs = Vec::new();
    for _ in 0..n.max(1) {
        addrs.push(format!("http://{}", null_executor::serve().await?));
    }
    Ok(addrs)
}

enum ControlPlane {
    External,
    InProcess(RunningServer, tempfile::TempDir),
    Child(ControlPlaneChild),
}

impl ControlPlane {
    /// Where it runs, as the report's `control_plane` field and the log line name it.
    fn placement(&self) -> &'static str {
        match self {
            ControlPlane::External => "external",
            ControlPlane::InProcess(..) => "in-process",
            ControlPlane::Child(_) => "own process",
        }
    }
}

async fn load(a: Args) -> Result<()> {
    let split = a.split || a.cp_cpus.is_some();
    let (cp, addr, token, tag) = match &a.addr {
        Some(addr) => {
            let token = match &a.token_file {
                Some(p) => Some(
                    std::fs::read_to_string(p)
                        .with_context(|| format!("reading {}", p.display()))?
                        .trim()
                        .to_string(),
                ),
                None => std::env::var("TINE_TOKEN").ok(),
            };
            let tag = a.tag.clone().unwrap_or_else(|| LOAD_TAG.into());
            (ControlPlane::External, addr.clone(), token, tag)
        }
        None if split => {
            let execs = null_executors(a.null_executors).await?;
            let cpus = a.cp_cpus.clone();
            let (child, serving) = tokio::task::spawn_blocking(move || {
                ControlPlaneChild::start(&execs, cpus.as_ref())
            })
            .await??;
            (
                ControlPlane::Child(child),
                serving.addr,
                Some(serving.token),
                LOAD_TAG.to_string(),
            )
        }
        None => {
            let dir = tempfile::tempdir()?;
            let execs = null_executors(a.null_executors).await?;
            let (cp, user) = embedded_control_plane(dir.path(), &execs).await?;
            let addr = format!("http://{}", cp.addr);
            (
                ControlPlane::InProcess(cp, dir),
                addr,
                Some(user),
                LOAD_TAG.to_string(),
            )
        }
    };
    let load = Load {
        addr: addr.clone(),
        token,
        tag,
        clients: a.clients,
        connections: a.connections,
        duration: Duration::from_secs(a.duration_secs),
        children_per_spawn: a.children_per_spawn,
        execs_per_child: a.execs_per_child,
        rate_per_client: a.rate_per_client,
    };
    let pinned = |c: &Option<CpuList>| {
        c.as_ref()
            .map_or("unpinned".to_string(), |c| format!("CPUs {c}"))
    };
    let placement = match &cp {
        ControlPlane::External => format!("{} control plane", cp.placement()),
        ControlPlane::InProcess(..) => format!(
            "{} control plane, SQLite + audit log on disk, {} null executors ({}): latencies are control-plane overhead",
            cp.placement(),
            a.null_executors,
            pinned(&a.load_cpus)
        ),
        ControlPlane::Child(_) => format!(
            "control plane in its {} ({}), SQLite + audit log on disk; {} null executors with the load ({}): latencies are control-plane overhead",
            cp.placement(),
            pinned(&a.cp_cpus),
            a.null_executors,
            pinned(&a.load_cpus)
        ),
    };
    eprintln!(
        "tine-loadtest: {} clients ({}) over {} connections for {} s against {} ({}); each loop: spawn {} child(ren), exec `true` {}x in each, kill each",
        a.clients,
        if a.rate_per_client > 0.0 { format!("{} loops/s each", a.rate_per_client) } else { "back to back".into() },
        a.connections,
        a.duration_secs,
        addr,
        placement,
        a.children_per_spawn,
        a.execs_per_child,
    );
    let (stats, wall) = run(load).await?;
    print!("{}", stats.table(wall));
    let params = serde_json::json!({
        "addr": addr, "clients": a.clients, "connections": a.connections, "duration_s": a.duration_secs,
        "children_per_spawn": a.children_per_spawn, "execs_per_child": a.execs_per_child,
        "rate_per_client": a.rate_per_client,
        "null_executors": (!matches!(cp, ControlPlane::External)).then_some(a.null_executors),
        "control_plane": cp.placement(),
        "cp_cpus": a.cp_cpus.as_ref().map(|c| c.to_string()),
        "load_cpus": a.load_cpus.as_ref().map(|c| c.to_string()),
    });
    let mut json = stats.json(wall, params);
    let report = match cp {
        ControlPlane::External => None,
        ControlPlane::InProcess(cp, _dir) => {
            let r = control_plane_report(&cp);
            cp.shutdown().await?;
            Some(r)
        }
        ControlPlane::Child(child) => {
            Some(tokio::task::spawn_blocking(move || child.finish()).await??)
        }
    };
    if let Some(r) = report {
        print!("{}", r["table"].as_str().unwrap_or_default());
        println!(
            "SQLite busy: {} inline statements found a lock held and went to the pool; {} pooled statements waited for the write lock",
            r["inline_busy_fallbacks"], r["write_lock_waits"]
        );
        for k in ["spawn_phases", "write_lock_waits", "inline_busy_fallbacks"] {
            json[k] = r[k].clone();
        }
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&json)?)?;
        eprintln!("tine-loadtest: JSON written to {}", p.display());
    }
    Ok(())
}
