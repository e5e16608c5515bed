//! What a child's VMM holds privately besides guest RAM, by part, measured on this machine's
//! own /dev/kvm: no Linux guest needed, so it runs anywhere the host tests run (PVM too).
//!
//! N children of a hand-made idle guest (1 vCPU, 32 MiB, a vsock device it never drives) are
//! spawned through the host crate from the given worker binary, confined as in production;
//! after they idle, each VMM's /proc/PID/smaps is read (Private_Clean + Private_Dirty: pages
//! no other process maps) and summed by part. Guest RAM is left out: this guest writes none.
//! At least two children: with one, the binary's clean pages are its alone and would count.
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
            other => {
                bail!("unknown argument {other:?} (--worker, --children, --idle-secs, --json)")
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

/// KiB per part of one VMM's smaps.
fn parts_of(smaps: &str, worker: &Path) -> BTreeMap<&'static str, u64> {
    let mut out: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut part: Option<&'static str> = None;
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            let path = line.split_whitespace().nth(5).unwrap_or("");
            part = if tine_host::hot::is_guest_ram(path) {
                None
            } else if Path::new(path) == worker {
                Some("binary")
            } else if path.starts_with('/') {
                Some("libraries")
            } else if path == "[heap]" {
                Some("heap")
            } else if path == "[stack]" {
                Some("main stack")
            } else if path.is_empty() {
                Some("other anonymous")
            } else {
                Some("other")
            };
        } else if first == "Private_Clean:" || first == "Private_Dirty:" {
            let kib: u64 = words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            if let Some(p) = part {
                *out.entry(p).or_default() += kib;
                *out.entry("total").or_default() += kib;
            }
        }
    }
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
    let host = Host::open_exclusive(cfg)?;
    host.fill_pool();
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
    for v in host.list() {
        let pid = v.record.process.pid;
        let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))
            .with_context(|| format!("reading the smaps of VMM {pid}"))?;
        per_child.push(parts_of(&smaps, &worker));
    }
    host.kill_all();

    println!(
        "VMM private memory per idle child: {} children of an idle hand-made guest (1 vCPU, \
         32 MiB, vsock), worker {}, read {:.1} s after all were ready; Private_Clean + \
         Private_Dirty from /proc/PID/smaps, guest RAM left out.\n",
        per_child.len(),
        worker.display(),
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
        let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
        let (min, max) = (v.iter().min().unwrap(), v.iter().max().unwrap());
        println!("| {part} | {mean:.1} | {min} | {max} |");
        json.insert(
            part.to_string(),
            serde_json::json!({"mean_kib": mean, "min_kib": min, "max_kib": max}),
        );
    }
    if let Some(path) = a.json {
        let doc = serde_json::json!({
            "children": per_child.len(),
            "worker": worker,
            "idle_secs": a.idle.as_secs_f64(),
            "parts": json,
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
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
