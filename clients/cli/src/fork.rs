//! `tine snapshot`, `tine fork`, `tine ls`, `tine kill`: warm a parent once, then fork children
//! from its snapshot. Each child is its own VMM process (a pre-started worker) restoring the
//! snapshot with its guest RAM mapped copy-on-write; "spawned" means its guest agent answered.

use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use tine_executor::parent::{create_snapshot, ParentSpec};
use tine_executor::ready::make_ready;
use tine_executor::worker::{start_child, WorkerPool};
use tine_vmm::host::KvmFlavor;

use crate::vms;

/// Most children one `tine fork` may ask for.
pub const MAX_CHILDREN: usize = 1000;

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
    tag: String,
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
    let made = create_snapshot(&ParentSpec {
        image: a.image,
        tag: a.tag.clone(),
        vcpus: a.vcpus,
        mem_mib: a.mem_mib,
        evals: a.evals,
        ready_timeout: Duration::from_secs(a.ready_timeout_secs),
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

/// One child as `tine fork` saw it.
#[derive(Clone, Debug)]
pub struct ChildReport {
    pub id: String,
    pub pid: u32,
    /// From just before spawning its process to its agent answering (and clock/RNG fixed).
    pub ready: Result<Duration, String>,
}

/// Fork `n` children from the snapshot `tag`, at most `parallel` restoring at once (0: all);
/// `report` is called (from several threads) as each becomes ready or fails. Each child is its
/// own VMM process: a `tine __vmm-worker` started before the clock runs, handed the snapshot.
/// A child's time runs from handing it the snapshot to its agent answering.
pub fn fork_children(
    tag: &str,
    n: usize,
    parallel: usize,
    timeout: Duration,
    report: impl Fn(ChildReport) + Sync,
) -> Result<()> {
    if n == 0 || n > MAX_CHILDREN {
        bail!("-n {n}: ask for 1..={MAX_CHILDREN} children");
    }
    let snap = vms::snapshot_dir(tag)?;
    // Validate once here so a bad snapshot fails the call, not N children.
    tine_vmm::snapshot::file::load_header(&snap)?;
    let pool = WorkerPool::prestarted(std::env::current_exe()?, n);
    let width = if parallel == 0 { n } else { parallel.min(n) };
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..width {
            s.spawn(|| loop {
                if next.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= n {
                    return;
                }
                let id = vms::new_id(tag);
                let t = Instant::now();
                let (pid, ready) = match start_child(&pool, tag, &snap, &id) {
                    Ok(c) => {
                        let ready = make_ready(&c.dir, c.pid, c.restored, timeout);
                        if ready.is_err() {
                            // SAFETY: kill(2) of the worker we just started.
                            unsafe { libc::kill(c.pid as i32, libc::SIGKILL) };
                        }
                        // Reap it when it ends, so no zombie outlives a long benchmark.
                        let mut child = c.child;
                        std::thread::spawn(move || child.wait());
                        (c.pid, ready.map(|()| t.elapsed()))
                    }
                    Err(e) => (0, Err(e)),
                };
                report(ChildReport { id, pid, ready });
            });
        }
    });
    Ok(())
}

#[derive(clap::Args)]
pub struct ForkArgs {
    /// Snapshot tag (from `tine snapshot`).
    #[arg(long)]
    tag: String,
    /// Number of children.
    #[arg(short = 'n', long, default_value_t = 1)]
    count: usize,
    #[arg(long, default_value_t = 300)]
    ready_timeout_secs: u64,
    /// At most this many children restoring at once (0: all of them).
    #[arg(long, default_value_t = 0)]
    parallel: usize,
    /// Print one JSON object per child instead of a table.
    #[arg(long)]
    json: bool,
    #[arg(long)]
    allow_pvm: bool,
}

pub fn fork(a: ForkArgs) -> Result<i32> {
    refuse_pvm(a.allow_pvm)?;
    let t0 = Instant::now();
    let results = std::sync::Mutex::new((Vec::new(), 0usize));
    let print = |r: ChildReport| {
        let mut g = results.lock().unwrap();
        match &r.ready {
            Ok(d) => {
                g.0.push(*d);
                if a.json {
                    println!(
                        "{{\"id\":{:?},\"pid\":{},\"ready_ms\":{:.3}}}",
                        r.id,
                        r.pid,
                        d.as_secs_f64() * 1e3
                    );
                } else {
                    println!(
                        "{:<28} pid {:<8} ready in {:>9.2} ms",
                        r.id,
                        r.pid,
                        d.as_secs_f64() * 1e3
                    );
                }
            }
            Err(e) => {
                g.1 += 1;
                if a.json {
                    println!("{{\"id\":{:?},\"pid\":{},\"error\":{:?}}}", r.id, r.pid, e);
                } else {
                    println!("{:<28} pid {:<8} FAILED: {e}", r.id, r.pid);
                }
            }
        }
    };
    fork_children(
        &a.tag,
        a.count,
        a.parallel,
        Duration::from_secs(a.ready_timeout_secs),
        print,
    )?;
    let (mut ok, failed) = results.into_inner().unwrap();
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
    let now = vms::now_ms();
    let vms = vms::list()?;
    println!(
        "{:<28} {:<8} {:<8} {:<20} {:>8}",
        "ID", "PID", "STATE", "SNAPSHOT", "AGE s"
    );
    for (_, m) in &vms {
        println!(
            "{:<28} {:<8} {:<8} {:<20} {:>8.1}",
            m.id,
            m.pid,
            if vms::alive(m.pid) {
                "running"
            } else {
                "exited"
            },
            m.tag.as_deref().unwrap_or("-"),
            now.saturating_sub(m.created_unix_ms) as f64 / 1000.0
        );
    }
    Ok(0)
}

#[derive(clap::Args)]
pub struct KillArgs {
    /// VM ids (see `tine ls`).
    ids: Vec<String>,
    /// Kill every VM.
    #[arg(long, conflicts_with = "ids")]
    all: bool,
}

pub fn kill(a: KillArgs) -> Result<i32> {
    if !a.all && a.ids.is_empty() {
        bail!("name VM ids to kill, or pass --all");
    }
    let targets = if a.all {
        vms::list()?
    } else {
        a.ids
            .iter()
            .map(|id| vms::find(id))
            .collect::<Result<Vec<_>>>()?
    };
    for (dir, m) in &targets {
        vms::kill(dir, m)?;
    }
    eprintln!("[tine] killed {} VM(s)", targets.len());
    Ok(0)
}
