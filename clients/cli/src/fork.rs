//! `tine snapshot`, `tine fork`, `tine ls`, `tine kill`: warm a parent once, then fork children
//! from its snapshot, all through the host crate (the same path the executor daemon takes).
//! Each child is its own VMM process (a pre-started worker) restoring the snapshot with its
//! guest RAM mapped copy-on-write; "spawned" means its guest agent answered.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tine_host::{Host, Liveness, Owner, ParentSpec, Readiness, SpawnOptions, SpawnOutcome};
use tine_proto::limits::MAX_SPAWN;
use tine_proto::names::{SandboxId, Tag};
use tine_vmm::host::KvmFlavor;

use crate::local::cli_host;

fn refuse_pvm(allow: bool) -> Result<()> {
    if KvmFlavor::detect() == KvmFlavor::Pvm && !allow {
        bail!("this host's /dev/kvm is PVM: Linux guests cannot run here; use `tine lab -- tine ...` (or --allow-pvm)");
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct SnapshotArgs {
    /// Guest image to boot (name, id or directory from `tine image build`).
    #[arg(long)]
    image: String,
    /// Name for the snapshot (letters, digits, `.`, `_`, `-`).
    #[arg(long)]
    tag: Tag,
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Guest memory (default: the image's recommendation).
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Python to run in the warm interpreter before the snapshot (repeatable), e.g. `x = 42`.
    #[arg(long = "eval", value_name = "CODE")]
    evals: Vec<String>,
    /// Replace an existing snapshot with this tag.
    #[arg(long)]
    force: bool,
    /// How long to wait for the agent's warm-up.
    #[arg(long, default_value_t = 900)]
    ready_timeout_secs: u64,
    #[arg(long)]
    allow_pvm: bool,
}

pub fn snapshot(a: SnapshotArgs) -> Result<i32> {
    refuse_pvm(a.allow_pvm)?;
    let host = cli_host(Readiness::Agent, true, Default::default())?;
    let made = host.create_snapshot(&ParentSpec {
        image: tine_image::ImageRef::Local(a.image),
        tag: a.tag.clone(),
        vcpus: a.vcpus,
        mem_mib: a.mem_mib,
        evals: a.evals,
        ready_timeout: Some(Duration::from_secs(a.ready_timeout_secs)),
        replace: a.force,
    })?;
    eprintln!(
        "[tine] snapshot {}: {} vCPU, {} MiB; parent ready after {:.2} s, snapshot written in {:.1} ms -> {}",
        a.tag,
        made.header.vcpus,
        made.header.mem_size >> 20,
        made.ready_after.as_secs_f64(),
        made.written_in.as_secs_f64() * 1000.0,
        made.dir.display()
    );
    Ok(0)
}

/// Fork `n` children from the snapshot `tag` on `host`, at most `parallel` restoring at once
/// (0: all); `report` is called (from several threads) as each becomes ready or fails. The
/// workers are started before the clock runs: a child's time runs from handing its worker
/// the snapshot to its agent answering.
pub fn fork_children(
    host: &Host,
    tag: &Tag,
    n: usize,
    opts: &SpawnOptions,
    report: impl Fn(SpawnOutcome) + Sync,
) -> Result<()> {
    if n == 0 || n > MAX_SPAWN as usize {
        bail!("-n {n}: ask for 1..={MAX_SPAWN} children");
    }
    // Validate first so a bad snapshot fails the call, not N children.
    host.snapshot_header(tag)?;
    // Primed for this snapshot too, before the clock.
    host.prestart_workers_for(tag, n)?;
    let ids = (0..n).map(|_| SandboxId::random(tag.as_str())).collect();
    host.spawn(tag, ids, opts, report)?;
    Ok(())
}

#[derive(clap::Args)]
pub struct ForkArgs {
    /// Snapshot tag (from `tine snapshot`).
    #[arg(long)]
    tag: Tag,
    /// Number of children.
    #[arg(short = 'n', long, default_value_t = 1)]
    count: usize,
    /// Per-child readiness deadline (default: the host's, 120 s).
    #[arg(long)]
    ready_timeout_secs: Option<u64>,
    /// At most this many children restoring at once (0: all of them).
    #[arg(long, default_value_t = 0)]
    parallel: usize,
    /// The snapshot's guest runs no Tine agent (a hand-made guest, a raw `tine run
    /// --snapshot-at` snapshot): a child is ready once its VMM runs the restored guest.
    #[arg(long)]
    no_agent: bool,
    /// Print one JSON object per child instead of a table.
    #[arg(long)]
    json: bool,
    /// Copy the snapshot's memory into shared memory before forking (before the clock), in
    /// huge pages where the host's shmem_enabled allows, and restore every child from that
    /// copy, as an executor does for a snapshot it spawns from often (a one-shot `tine fork`
    /// otherwise maps memory.img).
    #[arg(long)]
    hold_image: bool,
    /// Do not prime idle VMM workers for the snapshot spawned from (each child then loads
    /// the snapshot and maps its working set after its job arrives; see docs/performance.md).
    #[arg(long)]
    no_prime: bool,
    /// How the VMM workers are started: fork (from a zygote that loaded the worker program
    /// once, so they share the pages its loading wrote) or exec (each from the program, with
    /// an address-space layout of its own).
    #[arg(long, default_value_t = tine_host::WorkerStart::Fork)]
    worker_start: tine_host::WorkerStart,
    #[arg(long)]
    allow_pvm: bool,
}

pub fn fork(a: ForkArgs) -> Result<i32> {
    refuse_pvm(a.allow_pvm)?;
    let readiness = if a.no_agent {
        Readiness::Running
    } else {
        Readiness::Agent
    };
    let host = cli_host(readiness, !a.no_prime, a.worker_start)?;
    let opts = SpawnOptions {
        ready_timeout: a.ready_timeout_secs.map(Duration::from_secs),
        parallel: a.parallel,
        readiness: None,
        layer: None,
        fetch: None,
        network: None,
        resources: Default::default(),
    };
    if a.hold_image {
        host.hold_image(&a.tag)?;
    }
    let t0 = Instant::now();
    let results = std::sync::Mutex::new((Vec::new(), 0usize));
    let print = |o: SpawnOutcome| {
        let mut g = results.lock().unwrap_or_else(|p| p.into_inner());
        let pid = o.pid.unwrap_or(0);
        match &o.result {
            Ok(p) => {
                g.0.push(p.total);
                if a.json {
                    println!(
                        "{{\"id\":{:?},\"pid\":{pid},\"ready_ms\":{:.3}}}",
                        o.id.as_str(),
                        p.total.as_secs_f64() * 1e3
                    );
                } else {
                    println!(
                        "{:<28} pid {pid:<8} ready in {:>9.2} ms",
                        o.id,
                        p.total.as_secs_f64() * 1e3
                    );
                }
            }
            Err(e) => {
                g.1 += 1;
                if a.json {
                    println!(
                        "{{\"id\":{:?},\"pid\":{pid},\"error\":{:?}}}",
                        o.id.as_str(),
                        e.to_string()
                    );
                } else {
                    println!("{:<28} pid {pid:<8} FAILED: {e}", o.id);
                }
            }
        }
    };
    fork_children(&host, &a.tag, a.count, &opts, print)?;
    let (mut ok, failed) = results.into_inner().unwrap_or_else(|p| p.into_inner());
    let total = t0.elapsed();
    ok.sort();
    if !ok.is_empty() && !a.json {
        let p = |q: f64| ok[((ok.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
        println!(
            "{} ready, {failed} failed in {:.1} ms (per child p50 {:.1} ms, p90 {:.1} ms, max {:.1} ms)",
            ok.len(),
            total.as_secs_f64() * 1e3,
            p(0.5),
            p(0.9),
            p(1.0)
        );
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

#[derive(clap::Args)]
pub struct LsArgs {}

pub fn ls(_: LsArgs) -> Result<i32> {
    let host = cli_host(Readiness::Agent, true, Default::default())?;
    let now = tine_host::records::now_ms();
    println!(
        "{:<28} {:<8} {:<9} {:<20} {:<18} {:>8}",
        "ID", "PID", "STATE", "SNAPSHOT", "OWNER", "AGE s"
    );
    for vm in host.list() {
        let r = &vm.record;
        let owner = match &r.owner {
            Owner::Cli => "cli".to_string(),
            Owner::Executor(id) => format!("executor {id}"),
        };
        println!(
            "{:<28} {:<8} {:<9} {:<20} {:<18} {:>8.1}",
            r.id.as_str(),
            r.process.pid,
            match vm.liveness {
                Liveness::Running => "running",
                Liveness::Exited => "exited",
                Liveness::Replaced => "gone",
            },
            r.tag.as_ref().map_or("-", |t| t.as_str()),
            owner,
            now.saturating_sub(r.created_unix_ms) as f64 / 1000.0
        );
    }
    Ok(0)
}

#[derive(clap::Args)]
pub struct KillArgs {
    /// VM ids (see `tine ls`).
    ids: Vec<SandboxId>,
    /// Kill every VM this CLI started (an executor daemon's VMs are left to the daemon).
    #[arg(long, conflicts_with = "ids")]
    all: bool,
}

pub fn kill(a: KillArgs) -> Result<i32> {
    if !a.all && a.ids.is_empty() {
        bail!("name VM ids to kill, or pass --all");
    }
    let host = cli_host(Readiness::Agent, true, Default::default())?;
    let targets: Vec<SandboxId> = if a.all {
        let all = host.list();
        let skipped = all
            .iter()
            .filter(|v| v.record.owner != Owner::Cli && v.liveness == Liveness::Running)
            .count();
        if skipped > 0 {
            eprintln!("[tine] leaving {skipped} VM(s) of an executor daemon running (stop them through it: `tine sandbox kill ID`)");
        }
        all.into_iter()
            .filter(|v| v.record.owner == Owner::Cli || v.liveness != Liveness::Running)
            .map(|v| v.record.id)
            .collect()
    } else {
        a.ids
    };
    for id in &targets {
        host.kill_recorded(id)?;
    }
    eprintln!("[tine] killed {} VM(s)", targets.len());
    Ok(0)
}
