//! `tine-loadtest`: concurrent gRPC clients against a control plane.
//!
//! Without --addr it measures the control plane's own overhead: it starts one in this process
//! (real SQLite file, real audit log, real auth) with null executors behind it (loopback gRPC
//! servers that do no VM work), so each latency is everything except an executor's work.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use tine_control_plane::calls::Auth;
use tine_control_plane::db::{ExecutorReport, NewSnapshot};
use tine_control_plane::server::{self, ServerConfig};
use tine_loadtest::null_executor;
use tine_loadtest::run::{run, Load};
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
    /// File holding the token (with --addr).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Snapshot to spawn from (with --addr).
    #[arg(long, default_value = "load")]
    tag: String,
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
}

#[tokio::main]
async fn main() -> Result<()> {
    let a = Args::parse();
    let _dir;
    let mut embedded = None;
    let (addr, token, tag) = match &a.addr {
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
            (addr.clone(), token, a.tag.clone())
        }
        None => {
            _dir = tempfile::tempdir()?;
            let (user, exec) = (generate_token(), generate_token());
            let cp = server::start(ServerConfig {
                listen: "127.0.0.1:0".parse()?,
                db_path: _dir.path().join("tine.db"),
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
                audit_path: _dir.path().join("audit.log"),
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
                cached_tags: vec!["load".into()],
                ..Default::default()
            };
            for i in 0..a.null_executors.max(1) {
                let ex = null_executor::serve().await?;
                cp.ctx
                    .db
                    .upsert_executor(
                        &format!("null-{i}"),
                        &format!("http://{ex}"),
                        &report,
                        "loadtest",
                    )
                    .await?;
                if i == 0 {
                    cp.ctx
                        .db
                        .insert_snapshot(&NewSnapshot {
                            tag: "load".into(),
                            parent_tag: None,
                            image: "none".into(),
                            vcpus: 1,
                            mem_mib: 0,
                            source_sandbox: None,
                            executor_id: "null-0".into(),
                            layers: None,
                            state: tine_control_plane::db::NewState::Ready,
                        })
                        .await?;
                }
            }
            for i in 0..a.null_executors.max(1) {
                cp.ctx
                    .db
                    .heartbeat(&format!("null-{i}"), &report, "loadtest")
                    .await?;
            }
            let report = report.clone();
            // Keep the null executors "up" (heartbeats within three periods) for the whole run.
            let db = cp.ctx.db.clone();
            let n = a.null_executors.max(1);
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    for i in 0..n {
                        let _ = db
                            .heartbeat(&format!("null-{i}"), &report, "loadtest")
                            .await;
                    }
                }
            });
            let addr = format!("http://{}", cp.addr);
            embedded = Some(cp);
            (addr, Some(user), "load".to_string())
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
    eprintln!(
        "tine-loadtest: {} clients ({}) over {} connections for {} s against {} ({}); each loop: spawn {} child(ren), exec `true` {}x in each, kill each",
        a.clients,
        if a.rate_per_client > 0.0 { format!("{} loops/s each", a.rate_per_client) } else { "back to back".into() },
        a.connections,
        a.duration_secs,
        addr,
        if embedded.is_some() {
            format!("in-process control plane, SQLite + audit log on disk, {} null executors: latencies are control-plane overhead", a.null_executors)
        } else {
            "external control plane".into()
        },
        a.children_per_spawn,
        a.execs_per_child,
    );
    let (stats, wall) = run(load).await?;
    print!("{}", stats.table(wall));
    let params = serde_json::json!({
        "addr": addr, "clients": a.clients, "connections": a.connections, "duration_s": a.duration_secs,
        "children_per_spawn": a.children_per_spawn, "execs_per_child": a.execs_per_child,
        "rate_per_client": a.rate_per_client,
        "null_executors": embedded.as_ref().map(|_| a.null_executors),
    });
    let mut json = stats.json(wall, params);
    if let Some(cp) = &embedded {
        let phases = cp.ctx.metrics.spawn_phases();
        print!("{}", tine_loadtest::report::phase_table(&phases));
        let waits = tine_control_plane::lock_wait::waits();
        let fallbacks = tine_control_plane::db::inline_fallbacks();
        println!("SQLite busy: {fallbacks} inline statements found a lock held and went to the pool; {waits} pooled statements waited for the write lock");
        json["spawn_phases"] = tine_loadtest::report::phase_json(&phases);
        json["write_lock_waits"] = waits.into();
        json["inline_busy_fallbacks"] = fallbacks.into();
    }
    if let Some(p) = &a.json {
        std::fs::write(p, serde_json::to_vec_pretty(&json)?)?;
        eprintln!("tine-loadtest: JSON written to {}", p.display());
    }
    if let Some(cp) = embedded {
        cp.shutdown().await?;
    }
    Ok(())
}
