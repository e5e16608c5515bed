//! What a child's VMM holds privately besides guest RAM, by part, measured on this machine's
//! own /dev/kvm: no Linux guest needed, so it runs anywhere the host tests run (PVM too).
//!
//! N children of a hand-made idle guest (1 vCPU, 32 MiB, a vsock device it never drives) are
//! spawned through the host crate from the given worker binary, confined as in production;
//! after they idle, each VMM's /proc/PID/smaps is read (Private_Clean + Private_Dirty: pages
//! no other process maps) and summed by part. Guest RAM is left out: this guest writes none.
//! At least two children: with one, the binary's clean pages are its alone and would count.
//! Where the host gives children cgroups (cgroup v2 with the memory controller), a second
//! table shows what the kernel holds for each child besides those pages (its cgroup's
//! memory.stat: kernel stacks, page tables, KVM's page tables, slab, per-CPU, vmalloc).
//!
//! cargo build --release -p tine-cli --bin tine-vmm-worker
//! cargo run --release -p tine-host --features testing --example vmm_memory -- \
//!     --worker target/release/tine-vmm-worker --children 10 --json vmm-memory.json

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{bail, Context};
use tine_host::testing::{kvm_available, test_host_config, write_idle_guest_snapshot_with_vsock};
use tine_host::{Host, SpawnOptions};
use tine_proto::names::{SandboxId, Tag};

/// The parts a VMM's private memory is summed into, in the order printed.
const PARTS: [&str; 7] = [
    "binary",
    "libraries",
    "heap",
    "main stack",
    "other anonymous",
    "other",
    "total",
];

struct Args {
    worker: PathBuf,
    children: usize,
    idle: Duration,
    json: Option<PathBuf>,
    start: tine_host::WorkerStart,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        worker: std::env::current_exe()?
            .parent()
            .and_then(Path::parent)
            .context("no directory above the example's")?
            .join("tine-vmm-worker"),
        children: 10,
        idle: Duration::from_secs(1),
        json: None,
        start: tine_host::WorkerStart::default(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--worker" => a.worker = value()?.into(),
            "--children" => a.children = value()?.parse().context("--children")?,
            "--idle-secs" => {
                a.idle = Duration::from_secs_f64(value()?.parse().context("--idle-secs")?)
            }
            "--json" => a.json = Some(value()?.into()),
            "--worker-start" => a.start = value()?.parse().map_err(anyhow::Error::msg)?,
            other => {
                bail!("unknown argument {other:?} (--worker, --children, --idle-secs, --json, --worker-start)")
            }
        }
    }
    if a.children < 2 {
        bail!(
            "--children must be at least 2: one VMM alone holds its binary's clean pages privately"
        );
    }
    if !a.worker.is_file() {
        bail!(
            "no worker binary at {} (cargo build --release -p tine-cli --bin tine-vmm-worker)",
            a.worker.display()
        );
    }
    Ok(a)
}

/// The steps of a vmm.log's `main thread CPU ms` line: `main 1.2, ahead 0.4, ...`.
fn cpu_steps(log: &str) -> Vec<(String, f64)> {
    let Some(line) = log
        .lines()
        .find_map(|l| l.strip_prefix("tine-vmm: main thread CPU ms: "))
    else {
        return Vec::new();
    };
    line.split(", ")
        .filter_map(|kv| {
            let (k, v) = kv.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// KiB per part of one VMM's smaps.
fn parts_of(smaps: &str, worker: &Path) -> BTreeMap<&'static str, u64> {
    let mut out: BTreeMap<&'static str, u64> = BTreeMap::new();
    tine_host::smaps::for_each_field(smaps, |path, field, kib| {
        if field != "Private_Clean:" && field != "Private_Dirty:" {
            return;
        }
        let part = if tine_host::hot::is_guest_ram(path) {
            return;
        } else if Path::new(path) == worker {
            "binary"
        } else if path.starts_with('/') {
            "libraries"
        } else if path == "[heap]" {
            "heap"
        } else if path == "[stack]" {
            "main stack"
        } else if path.is_empty() {
            "other anonymous"
        } else {
            "other"
        };
        *out.entry(part).or_default() += kib;
        *out.entry("total").or_default() += kib;
    });
    out
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    if !kvm_available() {
        bail!("/dev/kvm is absent or not usable");
    }
    let worker = a.worker.canonicalize()?;
    let tmp = tempfile::tempdir()?;
    let dir = tmp.path().join("snapshots").join("idle");
    std::fs::create_dir_all(tmp.path().join("snapshots"))?;
    write_idle_guest_snapshot_with_vsock(&dir, 32)?;
    let mut cfg = test_host_config(tmp.path(), a.children as u32 + 1, a.children);
    cfg.worker_exe = worker.clone();
    cfg.cgroups = tine_host::CgroupMode::Auto;
    cfg.limits.worker_start = a.start;
    let host = Host::open_exclusive(cfg)?;
    let t0 = std::time::Instant::now();
    host.fill_pool();
    let pool_filled = t0.elapsed();
    let ids: Vec<SandboxId> = (0..a.children).map(|_| SandboxId::random("m")).collect();
    let failed = Mutex::new(Vec::new());
    host.spawn(&Tag::parse("idle")?, ids, &SpawnOptions::default(), |o| {
        if let Err(e) = o.result {
            failed.lock().unwrap().push(format!("{}: {e}", o.id));
        }
    })?;
    let failed = failed.into_inner().unwrap();
    if !failed.is_empty() {
        bail!("children not ready: {failed:?}");
    }
    std::thread::sleep(a.idle);
    let mut per_child = Vec::new();
    let mut kernel: Vec<BTreeMap<&'static str, u64>> = Vec::new();
    // Each worker's main-thread CPU per step, from its vmm.log.
    let mut cpu: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for v in host.list() {
        let log = std::fs::read_to_string(v.record.dir.join("vmm.log")).unwrap_or_default();
        for (step, ms) in cpu_steps(&log) {
            cpu.entry(step).or_default().push(ms);
        }
        let pid = v.record.process.pid;
        let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
            .with_context(|| format!("reading the smaps of VMM {pid}"))?;
        per_child.push(parts_of(&smaps, &worker));
        let counters = host
            .cgroup_dir(&v.record.id)
            .and_then(|d| tine_host::cgroup::kernel_memory(&d));
        let charged = host.usage(&v.record.id)?.map(|u| u.memory_current);
        if let Some((counters, charged)) = counters.zip(charged) {
            let mut k: BTreeMap<&'static str, u64> = counters.into_iter().collect();
            k.insert("kernel total", k.values().sum());
            k.insert("memory.current", charged);
            kernel.push(k.into_iter().map(|(n, b)| (n, b / 1024)).collect());
        }
    }
    host.kill_all();

    println!(
        "VMM private memory per idle child: {} children of an idle hand-made guest (1 vCPU, \
         32 MiB, vsock), worker {} (--worker-start {}), read {:.1} s after all were ready; \
         Private_Clean + Private_Dirty from /proc/PID/smaps, guest RAM left out.\n",
        per_child.len(),
        worker.display(),
        a.start,
        a.idle.as_secs_f64()
    );
    println!("| part | mean KiB | min KiB | max KiB |");
    println!("|-|--:|--:|--:|");
    let mut json = serde_json::Map::new();
    for part in PARTS {
        let v: Vec<u64> = per_child
            .iter()
            .map(|c| c.get(part).copied().unwrap_or(0))
            .collect();
        let (line, figures) = row(part, &v);
        println!("{line}");
        json.insert(part.to_string(), figures);
    }
    println!(
        "\nThe pool of {} workers started and waiting for their jobs in {:.1} ms (wall). Each \
         worker's main thread, CPU ms per step from its vmm.log (median over the children; \
         main and ahead are its start before any job):\n",
        per_child.len(),
        pool_filled.as_secs_f64() * 1e3
    );
    println!("| step | median CPU ms |");
    println!("|-|--:|");
    let mut cpu_json = serde_json::Map::new();
    for (step, mut v) in cpu {
        v.sort_by(f64::total_cmp);
        let median = v[v.len() / 2];
        println!("| {step} | {median:.2} |");
        cpu_json.insert(step, serde_json::json!(median));
    }
    let mut kernel_json = serde_json::Map::new();
    if kernel.is_empty() {
        println!(
            "\nno kernel figures: the children ran without cgroups ({})",
            host.cgroups_refused()
        );
    } else {
        println!(
            "\nWhat the kernel holds for each child, from its cgroup's memory.stat ({} children; \
             memory.current is all the cgroup is charged, the pages above included):\n",
            kernel.len()
        );
        println!("| kernel | mean KiB | min KiB | max KiB |");
        println!("|-|--:|--:|--:|");
        let mut keys: Vec<&'static str> = tine_host::cgroup::KERNEL_MEMORY.to_vec();
        keys.extend(["kernel total", "memory.current"]);
        for key in keys {
            let v: Vec<u64> = kernel.iter().filter_map(|k| k.get(key).copied()).collect();
            if v.is_empty() {
                continue;
            }
            let (row, mean) = row(key, &v);
            println!("{row}");
            kernel_json.insert(key.to_string(), mean);
        }
    }
    if let Some(path) = a.json {
        let doc = serde_json::json!({
            "children": per_child.len(),
            "worker": worker,
            "idle_secs": a.idle.as_secs_f64(),
            "worker_start": a.start.to_string(),
            "pool_filled_ms": pool_filled.as_secs_f64() * 1e3,
            "main_thread_cpu_ms": cpu_json,
            "parts": json,
            "kernel": kernel_json,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// A table row of `v` (KiB, one per child) and the same as JSON.
fn row(name: &str, v: &[u64]) -> (String, serde_json::Value) {
    let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
    let (min, max) = (v.iter().min().unwrap(), v.iter().max().unwrap());
    (
        format!("| {name} | {mean:.1} | {min} | {max} |"),
        serde_json::json!({"mean_kib": mean, "min_kib": min, "max_kib": max}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_are_summed_by_part() {
        let smaps = "\
55f9-55fa r--p 002d0000 fe:00 1 /opt/tine/tine-vmm-worker
Private_Clean:         0 kB
Private_Dirty:        96 kB
55fb-55fc rw-p 00000000 00:00 0                          [heap]
Private_Dirty:        52 kB
7f00-7f01 rw-p 00000000 00:00 0
Private_Dirty:         8 kB
7f02-7f03 r--p 001cf000 fe:00 2 /usr/lib/x86_64-linux-gnu/libc.so.6
Private_Clean:         4 kB
Private_Dirty:        16 kB
7f04-7f05 rw-p 00000000 00:00 0                          [stack]
Private_Dirty:        16 kB
7f06-7f07 rw-p 00000000 00:01 3                          /memfd:tine-hot-image (deleted)
Private_Dirty:      1024 kB
";
        let p = parts_of(smaps, Path::new("/opt/tine/tine-vmm-worker"));
        assert_eq!(p["binary"], 96);
        assert_eq!(p["heap"], 52);
        assert_eq!(p["other anonymous"], 8);
        assert_eq!(p["libraries"], 20);
        assert_eq!(p["main stack"], 16);
        assert_eq!(p["total"], 192);
    }
}
