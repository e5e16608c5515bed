//! `tine bench burst`: bursts of children spawned the way an executor daemon serves them,
//! not the way `tine bench fork` does. The fork bench pre-starts and primes exactly the
//! workers it needs before its clock; a daemon keeps pools (VMM workers, child networks) of
//! a set size that refill in the background, and a burst larger than them starts the rest
//! on the spot. So this opens a host configured as `tine up` opens its executor's (pools
//! that grow after bursts, child networks, cgroups), boots and snapshots a parent, and
//! times several bursts of the same size in a row, each once the pools have settled.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tine_host::network::NetConfig;
use tine_host::{Host, Limits, SpawnOptions, SpawnPhases};
use tine_proto::names::{SandboxId, Tag};

use crate::bench_fetch::p50;

#[derive(clap::Args)]
pub struct BurstBench {
    /// The image the parent boots.
    #[arg(long, default_value = "python-numpy")]
    image: String,
    /// Children per burst.
    #[arg(long, default_value_t = 30)]
    size: usize,
    /// Bursts in a row (each after the pools settle, its children killed after it).
    #[arg(long, default_value_t = 3)]
    bursts: usize,
    /// VMM workers kept started, as `tine up --pool`.
    #[arg(long, default_value_t = 8)]
    pool: usize,
    /// The most the worker pool grows to, as `tine up --pool-max` (at most --pool: fixed).
    #[arg(long, default_value_t = 32)]
    pool_max: usize,
    /// Child networks kept prepared, as `tine up --net-pool`.
    #[arg(long, default_value_t = 4)]
    net_pool: usize,
    /// The most the network pool grows to, as `tine up --net-pool-max`.
    #[arg(long, default_value_t = 32)]
    net_pool_max: usize,
    /// Children without networks (an executor run with --no-network).
    #[arg(long)]
    no_network: bool,
    /// How VMM workers are started, as `tine up --worker-start`.
    #[arg(long, default_value_t = tine_host::WorkerStart::Fork)]
    worker_start: tine_host::WorkerStart,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// How long a burst waits for the pools to be full before it starts anyway.
const SETTLE: Duration = Duration::from_secs(180);

struct Burst {
    /// Pool targets and what was ready when the burst started (workers primed for its
    /// snapshot, networks prepared).
    workers: (usize, usize),
    networks: (usize, usize),
    ready: usize,
    failed: usize,
    all_ready: Duration,
    ready_p50: f64,
    cpu_ms_per_child: Option<f64>,
    /// Mean ms per ready child, per phase, in `SpawnPhases::named` order.
    phase_means: Vec<(&'static str, f64)>,
    kill_all: Duration,
}

/// Until both pools hold their targets, the workers primed for `tag` (or `SETTLE` passed);
/// returns how long it took.
fn settle(host: &Host, tag: &Tag) -> Duration {
    let t = Instant::now();
    let full = || {
        host.primed_workers(tag) >= host.pool_target()
            && host.network().is_none_or(|n| n.idle() >= n.pool_target())
    };
    while !full() && t.elapsed() < SETTLE {
        std::thread::sleep(Duration::from_millis(100));
    }
    // Whatever the last refill started (priming, a namespace's rules) finishes.
    std::thread::sleep(Duration::from_millis(500));
    t.elapsed()
}

fn burst(host: &Host, tag: &Tag, size: usize) -> Result<Burst> {
    let workers = (host.pool_target(), host.primed_workers(tag));
    let networks = host
        .network()
        .map_or((0, 0), |n| (n.pool_target(), n.idle()));
    let ids: Vec<SandboxId> = (0..size).map(|_| SandboxId::random("burst")).collect();
    let outcomes = Mutex::new(Vec::new());
    let cpu0 = crate::bench::machine_busy_ms();
    let t0 = Instant::now();
    host.spawn(tag, ids, &SpawnOptions::default(), |o| {
        let at = t0.elapsed();
        outcomes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((o, at));
    })?;
    let all_ready = t0.elapsed();
    let cpu = crate::bench::machine_busy_ms()
        .zip(cpu0)
        .map(|(b, a)| (b - a) / size as f64);
    let outcomes = outcomes.into_inner().unwrap_or_else(|p| p.into_inner());
    let mut phases: Vec<SpawnPhases> = Vec::new();
    let mut at_ready = Vec::new();
    let mut failed = 0;
    for (o, at) in &outcomes {
        match &o.result {
            Ok(p) => {
                phases.push(*p);
                at_ready.push(at.as_secs_f64() * 1e3);
            }
            Err(e) => {
                failed += 1;
                eprintln!("  {} failed: {e}", o.id);
            }
        }
    }
    let names = SpawnPhases::default().named().map(|(n, _)| n);
    let phase_means = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let sum: f64 = phases
                .iter()
                .map(|p| p.named()[i].1.as_secs_f64() * 1e3)
                .sum();
            (*n, sum / phases.len().max(1) as f64)
        })
        .collect();
    let t = Instant::now();
    for (o, _) in &outcomes {
        if o.result.is_ok() {
            host.kill(&o.id)
                .with_context(|| format!("killing {}", o.id))?;
        }
    }
    Ok(Burst {
        workers,
        networks,
        ready: at_ready.len(),
        failed,
        all_ready,
        ready_p50: if at_ready.is_empty() {
            f64::NAN
        } else {
            p50(&mut at_ready)
        },
        cpu_ms_per_child: cpu,
        phase_means,
        kill_all: t.elapsed(),
    })
}

pub fn run(b: BurstBench) -> Result<i32> {
    if b.size == 0 || b.bursts == 0 {
        bail!("--size and --bursts must be at least 1");
    }
    let limits = Limits {
        pool_size: b.pool,
        pool_max: b.pool_max,
        worker_start: b.worker_start,
        ..Limits::default()
    };
    let base =
        crate::local::host_config(tine_host::Owner::Cli, limits, tine_host::Readiness::Agent)?;
    let scratch = crate::bench::scratch_dir(&base.data_dir, "bench-burst-")?;
    let mut cfg = base;
    cfg.data_dir = scratch.path().to_path_buf();
    cfg.limits.max_vms = cfg.limits.max_vms.max(b.size as u32);
    if !b.no_network {
        cfg.network = Some(NetConfig {
            pool: b.net_pool,
            pool_max: b.net_pool_max,
            ..NetConfig::default()
        });
    }
    let host = Host::open(cfg)?;
    host.fill_pool();
    let tag = Tag::parse("bench-burst")?;
    crate::bench::boot_parent(&host, &b.image, &tag, "booted")?;
    // One child first, as a daemon's first spawn from a snapshot: the pool primes for it.
    let first = burst(&host, &tag, 1)?;
    if first.ready != 1 {
        bail!("the first child did not become ready");
    }
    let mut rows = Vec::new();
    for i in 1..=b.bursts {
        let waited = settle(&host, &tag);
        eprintln!(
            "burst {i}/{}: {} children (pools settled after {:.1} s)",
            b.bursts,
            b.size,
            waited.as_secs_f64()
        );
        rows.push(burst(&host, &tag, b.size)?);
    }
    if let Some(n) = host.network() {
        n.remove_host_table();
    }
    print_table(&b, &rows);
    if let Some(path) = &b.json {
        std::fs::write(path, json(&b, &rows).to_string())
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(if rows.iter().any(|r| r.failed > 0) {
        1
    } else {
        0
    })
}

fn print_table(b: &BurstBench, rows: &[Burst]) {
    println!(
        "burst benchmark: image {:?}, {} bursts of {} children, as an executor daemon serves them",
        b.image, b.bursts, b.size
    );
    println!("how: one host configured as `tine up`'s executor (workers: --pool {} growing to {}, started by {} (--worker-start); child networks: {}), a parent booted and snapshotted, one child spawned (the pool primes for its snapshot), then each burst once both pools hold their targets (or after {} s); its children are killed after it.",
        b.pool, b.pool_max, b.worker_start,
        if b.no_network { "none".to_string() } else { format!("--net-pool {} growing to {}", b.net_pool, b.net_pool_max) },
        SETTLE.as_secs());
    println!("     all ready = wall time of the spawn call until every child is ready; ready p50 = when the median child was; CPU/child = the whole machine's busy CPU (/proc/stat) over the call, divided by N; phases = mean ms per ready child; pools = target/ready at the burst's start (workers primed for the snapshot, networks prepared).");
    println!();
    println!(
        "{:>5} {:>12} {:>12} {:>12} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>7}",
        "burst",
        "all ready ms",
        "ready p50 ms",
        "CPU/child ms",
        "network",
        "handoff",
        "restore",
        "running",
        "agent",
        "kill all ms",
        "workers t/i",
        "networks t/i",
        "failed"
    );
    for (i, r) in rows.iter().enumerate() {
        let ph = |n: &str| {
            r.phase_means
                .iter()
                .find(|(k, _)| *k == n)
                .map_or(f64::NAN, |(_, v)| *v)
        };
        println!(
            "{:>5} {:>12.1} {:>12.1} {:>12} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>12} {:>12} {:>7}",
            i + 1,
            r.all_ready.as_secs_f64() * 1e3,
            r.ready_p50,
            r.cpu_ms_per_child
                .map_or("-".to_string(), |c| format!("{c:.0}")),
            ph("network"),
            ph("handoff"),
            ph("restore"),
            ph("running"),
            ph("agent"),
            r.kill_all.as_secs_f64() * 1e3,
            format!("{}/{}", r.workers.0, r.workers.1),
            format!("{}/{}", r.networks.0, r.networks.1),
            r.failed
        );
    }
}

fn json(b: &BurstBench, rows: &[Burst]) -> serde_json::Value {
    serde_json::json!({
        "bench": "burst",
        "image": b.image,
        "size": b.size,
        "pool": b.pool,
        "pool_max": b.pool_max,
        "worker_start": b.worker_start.to_string(),
        "net_pool": if b.no_network { None } else { Some(b.net_pool) },
        "net_pool_max": if b.no_network { None } else { Some(b.net_pool_max) },
        "bursts": rows.iter().map(|r| serde_json::json!({
            "ready": r.ready,
            "failed": r.failed,
            "all_ready_ms": r.all_ready.as_secs_f64() * 1e3,
            "ready_p50_ms": r.ready_p50,
            "cpu_ms_per_child": r.cpu_ms_per_child,
            "phase_means_ms": r.phase_means.iter().map(|(n, v)| (n.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
            "kill_all_ms": r.kill_all.as_secs_f64() * 1e3,
            "workers_target_idle": [r.workers.0, r.workers.1],
            "networks_target_idle": [r.networks.0, r.networks.1],
        })).collect::<Vec<_>>(),
    })
}
