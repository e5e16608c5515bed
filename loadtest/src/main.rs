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
use tine_control_plane::calls::{Auth, SandboxTimeouts};
use tine_control_plane::db::{ExecutorReport, NewSnapshot};
use tine_control_plane::metrics::PhaseMark;
use tine_control_plane::server::{self, RunningServer, ServerConfig};
use tine_loadtest::null_executor;
use tine_loadtest::run::{run, Load};
use tine_loadtest::split::{self, ControlPlaneChild, CpuList, History};
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
    /// Children spawned before the clock starts and kept live for the whole run (killed
    /// after it), so each spawn is placed among as many live sandboxes as a busy fleet holds.
    #[arg(long, default_value_t = 0)]
    standing: u32,
    /// Ended sandboxes recorded before the run, as a busy control plane's history holds (a
    /// week of it by default): written straight into the embedded control plane's database.
    #[arg(long, default_value_t = 0, conflicts_with = "addr")]
    history: u64,
    /// The recorded history ended evenly over this many days up to now. More than the
    /// control plane's retention (a week) leaves some past it, for its next pass (every
    /// minute) to forget while the load runs.
    #[arg(long, default_value_t = 7, value_parser = clap::value_parser!(u32).range(1..=3650))]
    history_days: u32,
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

impl Args {
    fn history(&self) -> History {
        History {
            count: self.history,
            days: self.history_days,
        }
    }
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
    history: History,
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
    if history.count > 0 {
        let (path, n) = (dir.join("tine.db"), null_executors.len());
        let started = std::time::Instant::now();
        tokio::task::spawn_blocking(move || write_history(&path, history, n)).await??;
        eprintln!(
            "tine-loadtest: {} ended sandboxes recorded (over {} days) in {:.1} s",
            history.count,
            history.days,
            started.elapsed().as_secs_f64()
        );
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

/// Record the sandboxes of `history` (killed, each with the default timeout's expiry), spread
/// over `executors` null executors, in one transaction.
fn write_history(db: &std::path::Path, history: History, executors: usize) -> Result<()> {
    let span_ms = i64::from(history.days) * 86_400_000;
    let now = i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis(),
    )?;
    let mut conn = rusqlite::Connection::open(db)
        .with_context(|| format!("opening {} to write history", db.display()))?;
    conn.busy_timeout(Duration::from_secs(30))?;
    let tx = conn.transaction()?;
    // Oldest first, evenly over the span; each lived a second.
    tx.execute(
        "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < ?1) \
         INSERT INTO sandboxes (id, tag, executor_id, state, created_ms, ended_ms, expires_ms) \
         SELECT 'history-' || i, ?2, 'null-' || (i % ?3), 'killed', \
                ?4 - ?5 + i * (?5 / ?1), ?4 - ?5 + i * (?5 / ?1) + 1000, \
                ?4 - ?5 + i * (?5 / ?1) + 300000 FROM n",
        rusqlite::params![
            history.count as i64,
            LOAD_TAG,
            executors as i64,
            now,
            span_ms
        ],
    )
    .context("writing history")?;
    tx.commit()?;
    Ok(())
}

/// Where the control plane's counters stood when the load began (after any standing
/// children were spawned), so its report covers the load alone.
#[derive(Default)]
struct Mark {
    phases: PhaseMark,
    write_lock_waits: u64,
    inline_busy_fallbacks: u64,
    forgotten: u64,
}

impl Mark {
    fn now(cp: &RunningServer) -> Mark {
        Mark {
            phases: cp.ctx.metrics.spawn_phase_mark(),
            write_lock_waits: tine_control_plane::lock_wait::waits(),
            inline_busy_fallbacks: tine_control_plane::db::inline_fallbacks(),
            forgotten: cp.ctx.metrics.sandboxes_forgotten.get(),
        }
    }
}

/// The control plane's own counters since `mark`, for the report: phase table text and JSON
/// fields.
fn control_plane_report(cp: &RunningServer, mark: &Mark) -> serde_json::Value {
    let phases = cp.ctx.metrics.spawn_phases_since(&mark.phases);
    serde_json::json!({
        "table": tine_loadtest::report::phase_table(&phases),
        "spawn_phases": tine_loadtest::report::phase_json(&phases),
        "write_lock_waits": tine_control_plane::lock_wait::waits() - mark.write_lock_waits,
        "inline_busy_fallbacks": tine_control_plane::db::inline_fallbacks() - mark.inline_busy_fallbacks,
        "forgotten": cp.ctx.metrics.sandboxes_forgotten.get() - mark.forgotten,
    })
}

async fn serve_control_plane(a: &Args) -> Result<()> {
    if a.null_executor_addr.is_empty() {
        anyhow::bail!("--serve-control-plane needs at least one --null-executor-addr");
    }
    let dir = tempfile::tempdir()?;
    let (cp, token) =
        embedded_control_plane(dir.path(), &a.null_executor_addr, a.history()).await?;
    split::tell_parent(
        &serde_json::json!({"addr": format!("http://{}", cp.addr), "token": token}),
    )?;
    let mut mark = Mark::default();
    let mut lines = split::parent_lines();
    while let Some(line) = lines.recv().await {
        if line != split::MARK {
            anyhow::bail!(
                "the load process sent {line:?}; only {:?} is understood",
                split::MARK
            );
        }
        mark = Mark::now(&cp);
        split::tell_parent(&serde_json::json!({"marked": true}))?;
    }
    split::tell_parent(&control_plane_report(&cp, &mark))?;
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
            let history = a.history();
            let (child, serving) = tokio::task::spawn_blocking(move || {
                ControlPlaneChild::start(&execs, cpus.as_ref(), history)
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
            let (cp, user) = embedded_control_plane(dir.path(), &execs, a.history()).await?;
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
        "tine-loadtest: {} clients ({}) over {} connections for {} s against {} ({}); each loop: spawn {} child(ren), exec `true` {}x in each, kill each; {} standing children live throughout, {} ended ones recorded before",
        a.clients,
        if a.rate_per_client > 0.0 { format!("{} loops/s each", a.rate_per_client) } else { "back to back".into() },
        a.connections,
        a.duration_secs,
        addr,
        placement,
        a.children_per_spawn,
        a.execs_per_child,
        a.standing,
        a.history,
    );
    let standing = if a.standing > 0 {
        // Outlive the run (and standing up) with a margin, but not by much if it is cut short.
        let lifetime = Duration::from_secs(
            (a.duration_secs + 600).min(u64::from(SandboxTimeouts::default().max_s)),
        );
        tine_loadtest::run::stand_up(&load, a.standing, lifetime).await?
    } else {
        Vec::new()
    };
    // The control plane's figures cover the load alone, not the standing children's spawns.
    let mut cp = cp;
    let mark = match &mut cp {
        ControlPlane::InProcess(server, _) => Mark::now(server),
        ControlPlane::Child(child) => {
            tokio::task::block_in_place(|| child.mark())?;
            Mark::default()
        }
        ControlPlane::External => Mark::default(),
    };
    let (stats, wall) = run(load.clone()).await?;
    if !standing.is_empty() {
        let failed = tine_loadtest::run::stand_down(&load, standing).await?;
        if failed > 0 {
            eprintln!("tine-loadtest: {failed} standing children could not be killed");
        }
    }
    print!("{}", stats.table(wall));
    let params = serde_json::json!({
        "addr": addr, "clients": a.clients, "connections": a.connections, "duration_s": a.duration_secs,
        "children_per_spawn": a.children_per_spawn, "execs_per_child": a.execs_per_child,
        "rate_per_client": a.rate_per_client, "standing": a.standing, "history": a.history, "history_days": a.history_days,
        "null_executors": (!matches!(cp, ControlPlane::External)).then_some(a.null_executors),
        "control_plane": cp.placement(),
        "cp_cpus": a.cp_cpus.as_ref().map(|c| c.to_string()),
        "load_cpus": a.load_cpus.as_ref().map(|c| c.to_string()),
    });
    let mut json = stats.json(wall, params);
    let report = match cp {
        ControlPlane::External => None,
        ControlPlane::InProcess(cp, _dir) => {
            let r = control_plane_report(&cp, &mark);
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
        if r["forgotten"].as_u64().is_some_and(|n| n > 0) {
            println!(
                "history: {} ended sandboxes forgotten past the retention during the run",
                r["forgotten"]
            );
        }
        for k in [
            "spawn_phases",
            "write_lock_waits",
            "inline_busy_fallbacks",
            "forgotten",
        ] {
            json[k] = r[k].clone();
        }
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&json)?)?;
        eprintln!("tine-loadtest: JSON written to {}", p.display());
    }
    Ok(())
}
