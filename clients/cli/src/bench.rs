//! `tine bench ...`: measurements printed as tables (and JSON), never asserted.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tine_host::{SpawnOptions, SpawnOutcome, SpawnPhases};
use tine_image::BOOT_MARKER;

use crate::defaults;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Cold boot: time from starting the VMM process to the guest's boot marker on the serial
    /// console, and to the VMM's exit after the guest powers off.
    Boot(BootBench),
    /// Fork: spawn-to-ready of N children from a warm snapshot beside a cold boot of the same
    /// image to ready, memory per idle child, and the host's bare KVM VM-creation floor.
    Fork(ForkBench),
    /// Guest agent: ping, exec round trip and warm eval latency beside a cold interpreter.
    Agent(tine_agent::bench::BenchArgs),
    /// Snapshots across hosts: the first child on a cold host (layers only in the store:
    /// eager, lazy, lazy + working set) against a warm host, bytes fetched before ready, and
    /// the snapshot's stored size.
    Fetch(crate::bench_fetch::FetchBench),
    /// Branch: the pause window of DIFF and FULL branches after N MiB written (beside a bare
    /// pause + resume), the call's return time, and spawn-to-ready from depth 0..D of a chain.
    Branch(crate::bench_branch::BranchBench),
    /// Child networks: spawn-to-ready with and without a network, TCP throughput between a
    /// guest and a server on this host (iperf3), requests per second to an exposed port.
    Net(crate::bench_net::NetBench),
}

#[derive(clap::Args)]
pub struct BootBench {
    /// Kernels to compare (default: the cloud kernel as ELF vmlinux via PVH, and as bzImage).
    #[arg(long = "kernel")]
    kernels: Vec<PathBuf>,
    /// Initramfs whose /init prints the boot marker (default: the smoke image).
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Boots per kernel.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    #[arg(long, default_value_t = 256)]
    mem_mib: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

pub fn run(c: BenchCommand) -> Result<i32> {
    match c {
        BenchCommand::Boot(b) => boot(b),
        BenchCommand::Fork(f) => fork_bench(f),
        BenchCommand::Agent(a) => tine_agent::bench::run(&a).map(|()| 0),
        BenchCommand::Fetch(f) => crate::bench_fetch::run(f),
        BenchCommand::Branch(b) => crate::bench_branch::run(b),
        BenchCommand::Net(b) => crate::bench_net::run(b),
    }
}

struct Sample {
    to_marker: Duration,
    to_exit: Duration,
}

fn one_boot(kernel: &PathBuf, initrd: &PathBuf, vcpus: u8, mem_mib: u64) -> Result<Sample> {
    let exe = std::env::current_exe().context("locating the tine binary")?;
    let start = Instant::now();
    let mut child = Command::new(exe)
        .args([
            "run",
            "--quiet",
            "--vcpus",
            &vcpus.to_string(),
            "--mem-mib",
            &mem_mib.to_string(),
        ])
        .arg("--kernel")
        .arg(kernel)
        .arg("--initrd")
        .arg(initrd)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting tine run")?;
    let stdout = child.stdout.take().expect("piped stdout");
    let mut to_marker = None;
    for line in BufReader::new(stdout).lines() {
        let line = line?;
        if to_marker.is_none() && line.contains(BOOT_MARKER) {
            to_marker = Some(start.elapsed());
        }
    }
    let status = child.wait()?;
    let to_exit = start.elapsed();
    let Some(to_marker) = to_marker else {
        bail!(
            "{} never printed {BOOT_MARKER} (exit {status})",
            kernel.display()
        );
    };
    if !status.success() {
        bail!("tine run exited with {status} for {}", kernel.display());
    }
    Ok(Sample { to_marker, to_exit })
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let p50 = v[v.len() / 2];
    (v[0], p50, v[v.len() - 1])
}

fn boot(b: BootBench) -> Result<i32> {
    if b.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let initrd = match b.initrd {
        Some(i) => i,
        None => defaults::smoke_initrd()?,
    };
    let kernels = if b.kernels.is_empty() {
        let k =
            tine_image::fetch_kernel(tine_image::Flavor::Cloud, &tine_image::default_cache_dir())?;
        vec![k.vmlinux()?, k.vmlinuz.clone()]
    } else {
        b.kernels
    };
    println!(
        "cold boot: wall time from spawning `tine run` to the guest's \"{BOOT_MARKER}\" line on the \
         serial console, and to the VMM process exit after poweroff; {} run(s) each, {} vCPU, {} MiB",
        b.runs, b.vcpus, b.mem_mib
    );
    println!(
        "{:<48} {:>10} {:>10} {:>10} {:>12}",
        "kernel", "min ms", "p50 ms", "max ms", "exit p50 ms"
    );
    let mut json = Vec::new();
    for k in &kernels {
        let mut samples = Vec::new();
        for i in 0..b.runs {
            let s = one_boot(k, &initrd, b.vcpus, b.mem_mib)?;
            eprintln!(
                "  {} run {}/{}: marker {:.1} ms, exit {:.1} ms",
                k.file_name().unwrap_or_default().to_string_lossy(),
                i + 1,
                b.runs,
                ms(s.to_marker),
                ms(s.to_exit)
            );
            samples.push(s);
        }
        let (min, p50, max) = stats(samples.iter().map(|s| ms(s.to_marker)).collect());
        let (_, exit_p50, _) = stats(samples.iter().map(|s| ms(s.to_exit)).collect());
        let name = k
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        println!("{name:<48} {min:>10.1} {p50:>10.1} {max:>10.1} {exit_p50:>12.1}");
        json.push(format!(
            "{{\"kernel\":{:?},\"runs\":{},\"marker_ms\":{{\"min\":{min:.3},\"p50\":{p50:.3},\"max\":{max:.3}}},\"exit_ms_p50\":{exit_p50:.3}}}",
            name, b.runs
        ));
    }
    let doc = format!(
        "{{\"bench\":\"boot\",\"vcpus\":{},\"mem_mib\":{},\"results\":[{}]}}",
        b.vcpus,
        b.mem_mib,
        json.join(",")
    );
    println!("json: {doc}");
    if let Some(p) = b.json {
        std::fs::write(&p, &doc).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(0)
}

#[derive(clap::Args)]
pub struct ForkBench {
    /// Snapshot tag to fork from (made with `tine snapshot`).
    #[arg(long)]
    tag: tine_proto::names::Tag,
    /// The image the snapshot was made from, for the cold-boot comparison.
    #[arg(long)]
    image: String,
    /// Fan-out sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,10,100")]
    counts: Vec<usize>,
    /// Cold boots to time.
    #[arg(long, default_value_t = 3)]
    cold_runs: usize,
    /// At most this many children restoring at once (0: all of them).
    #[arg(long, default_value_t = 0)]
    parallel: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn pct(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// A process's PSS (proportional set size: its share of every page it maps) in KiB, split into (guest RAM: the snapshot's `memory.img` mapping, pages
/// shared with the page cache counted by share and the guest's own writes in full; everything
/// else: the VMM's code, heap, stacks).
fn pss_split_kib(pid: u32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let (mut guest, mut vmm) = (0u64, 0u64);
    let mut in_guest = false;
    for l in s.lines() {
        let mut words = l.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping header: "start-end perms offset dev inode [path]".
            in_guest = l.ends_with("/memory.img");
        } else if first == "Pss:" {
            let kib: u64 = words.next().and_then(|v| v.parse().ok()).unwrap_or(0);
            if in_guest {
                guest += kib;
            } else {
                vmm += kib;
            }
        }
    }
    Some((guest, vmm))
}

/// Cold boot of the image to agent-ready, in a separate `tine run` process.
fn cold_boot(image: &str) -> Result<Duration> {
    let exe = std::env::current_exe()?;
    let dir = crate::local::data_dir(None)?
        .join("vms")
        .join(tine_proto::names::SandboxId::random("cold").as_str());
    std::fs::create_dir_all(&dir)?;
    let sock = dir.join("vsock.sock");
    let start = Instant::now();
    let mut child = Command::new(exe)
        .args(["run", "--quiet", "--image", image, "--console"])
        .arg(dir.join("console.log"))
        .arg("--vsock")
        .arg(&sock)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let client = tine_host::ready::agent(&sock);
    let r = client.wait_ready_polling(
        Duration::from_secs(900),
        Duration::from_millis(1),
        Duration::from_millis(1),
    );
    let took = start.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    r.context("cold boot never became ready")?;
    Ok(took)
}

/// Bare KVM floor: create a VM with irqchip, PIT, one vCPU and a memory slot, then drop it.
fn kvm_floor_ms(runs: usize) -> Result<Vec<f64>> {
    let mut v = Vec::new();
    for _ in 0..runs {
        let t = Instant::now();
        let vm = tine_vmm::Vm::create(
            1,
            tine_vmm::GuestRam::new_memfd(64)?,
            Box::new(std::io::sink()),
        )?;
        v.push(t.elapsed().as_secs_f64() * 1e3);
        drop(vm);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v)
}

fn fork_bench(b: ForkBench) -> Result<i32> {
    if b.counts.is_empty() || b.cold_runs == 0 {
        bail!("--counts and --cold-runs must not be empty/zero");
    }
    println!(
        "fork benchmark: snapshot {:?}, image {:?}",
        b.tag.as_str(),
        b.image
    );
    println!("how: each child = one VMM process (a `tine __vmm-worker` pre-started before the clock) handed the snapshot, restoring it (guest RAM mapped MAP_PRIVATE);");
    println!("     ready = its guest agent answered a ping over vsock and took the host's clock and fresh entropy;");
    println!("     per-child time runs from handing its worker the snapshot; total = wall time until all N are ready (--parallel {}: at most that many restoring at once, 0 = all);", b.parallel);
    println!("     cold = `tine run --image` to agent ready;");
    println!(
        "     memory = PSS of the child VMM processes after all are ready and idle, divided by N, split into guest RAM (the memory.img mapping: shared pages by share, pages the guest wrote in full) and the VMM process itself."
    );
    let mut cold: Vec<f64> = Vec::new();
    for i in 0..b.cold_runs {
        let d = cold_boot(&b.image)?;
        eprintln!(
            "  cold boot {}/{}: {:.1} ms",
            i + 1,
            b.cold_runs,
            d.as_secs_f64() * 1e3
        );
        cold.push(d.as_secs_f64() * 1e3);
    }
    cold.sort_by(|a, b| a.total_cmp(b));
    let cold_p50 = pct(&cold, 0.5);
    let floor = kvm_floor_ms(20)?;
    println!(
        "\ncold boot to ready: p50 {cold_p50:.1} ms (min {:.1}, max {:.1}, n={})",
        cold[0],
        cold[cold.len() - 1],
        cold.len()
    );
    println!("KVM VM-creation floor (VM + irqchip + PIT + 1 vCPU + memory slot, in-process): p50 {:.3} ms", pct(&floor, 0.5));
    println!(
        "\n{:>6} {:>12} {:>10} {:>10} {:>10} {:>12} {:>10} {:>10} {:>10} {:>8}",
        "N",
        "total ms",
        "p50 ms",
        "p90 ms",
        "max ms",
        "vs cold p50",
        "MiB/child",
        "guest RAM",
        "VMM",
        "failed"
    );
    let mut rows = Vec::new();
    let mut phase_rows: Vec<(usize, Vec<SpawnPhases>)> = Vec::new();
    let host = crate::local::cli_host(tine_host::Readiness::Agent)?;
    let opts = SpawnOptions {
        ready_timeout: Some(Duration::from_secs(300)),
        parallel: b.parallel,
        readiness: None,
        layer: None,
        fetch: None,
        network: None,
        resources: Default::default(),
    };
    for &n in &b.counts {
        let t0 = Instant::now();
        let collected = std::sync::Mutex::new(Vec::new());
        crate::fork::fork_children(&host, &b.tag, n, &opts, |r| {
            collected.lock().unwrap().push(r)
        })?;
        let reports: Vec<SpawnOutcome> = collected.into_inner().unwrap();
        let total = t0.elapsed().as_secs_f64() * 1e3;
        let phases: Vec<SpawnPhases> = reports
            .iter()
            .filter_map(|r| r.result.as_ref().ok().copied())
            .collect();
        let mut ready: Vec<f64> = phases.iter().map(|p| p.total.as_secs_f64() * 1e3).collect();
        ready.sort_by(|a, b| a.total_cmp(b));
        let failed = reports.len() - ready.len();
        for r in reports.iter() {
            if let Err(e) = &r.result {
                eprintln!("  child {} failed: {e}", r.id);
            }
        }
        phase_rows.push((n, phases));
        std::thread::sleep(Duration::from_millis(500)); // let children go idle
        let split: Vec<(u64, u64)> = reports
            .iter()
            .filter_map(|r| r.pid.and_then(pss_split_kib))
            .collect();
        let guest_kib: u64 = split.iter().map(|s| s.0).sum();
        let vmm_kib: u64 = split.iter().map(|s| s.1).sum();
        let mib_per_child = (guest_kib + vmm_kib) as f64 / 1024.0 / n as f64;
        let guest_mib = guest_kib as f64 / 1024.0 / n as f64;
        let vmm_mib = vmm_kib as f64 / 1024.0 / n as f64;
        for r in &reports {
            let _ = host.kill(&r.id);
        }
        if ready.is_empty() {
            println!(
                "{n:>6} {total:>12.1} {:>10} {:>10} {:>10} {:>12} {:>10} {:>10} {:>10} {failed:>8}",
                "-", "-", "-", "-", "-", "-", "-"
            );
            continue;
        }
        let (p50, p90, max) = (pct(&ready, 0.5), pct(&ready, 0.9), ready[ready.len() - 1]);
        // Spawning N from a snapshot vs cold-booting N (one at a time, as measured).
        let ratio = (cold_p50 * n as f64) / total;
        println!("{n:>6} {total:>12.1} {p50:>10.1} {p90:>10.1} {max:>10.1} {ratio:>11.1}x {mib_per_child:>10.2} {guest_mib:>10.2} {vmm_mib:>10.2} {failed:>8}");
        rows.push(format!(
            "{{\"n\":{n},\"total_ms\":{total:.3},\"p50_ms\":{p50:.3},\"p90_ms\":{p90:.3},\"max_ms\":{max:.3},\"ratio_vs_cold\":{ratio:.2},\"mib_per_child\":{mib_per_child:.3},\"guest_ram_mib_per_child\":{guest_mib:.3},\"vmm_mib_per_child\":{vmm_mib:.3},\"failed\":{failed}}}"
        ));
    }
    println!("\n`vs cold p50` = N x (cold boot p50) / (wall time to get all N children ready).");
    let phases_json = print_phase_table(&phase_rows);
    let doc = format!(
        "{{\"bench\":\"fork\",\"tag\":{:?},\"cold_ready_ms_p50\":{cold_p50:.3},\"kvm_floor_ms_p50\":{:.3},\"rows\":[{}],\"phases\":[{}]}}",
        b.tag.as_str(),
        pct(&floor, 0.5),
        rows.join(","),
        phases_json.join(",")
    );
    println!("json: {doc}");
    if let Some(p) = b.json {
        std::fs::write(&p, &doc).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(0)
}

/// Where each child's time went: p50 / p90 of every spawn phase per fan-out size, as a table;
/// returns the same figures as JSON objects.
fn print_phase_table(rows: &[(usize, Vec<SpawnPhases>)]) -> Vec<String> {
    println!("\nspawn phases per child (ms, p50 / p90), as the host measured them:");
    println!("  handoff = child record + a pre-started worker handed the snapshot; restore = KVM restore in the worker;");
    println!("  running = vCPUs started + report back; agent = first agent answer; fixup = clock + reseed");
    let names = SpawnPhases::default().named().map(|(name, _)| name);
    let header: Vec<String> = names.iter().map(|n| format!("{n:>17}")).collect();
    println!("{:>6} {}", "N", header.join(" "));
    let mut json = Vec::new();
    for (n, phases) in rows {
        if phases.is_empty() {
            continue;
        }
        let cols: Vec<(&str, (f64, f64))> = (0..names.len())
            .map(|i| {
                let mut v: Vec<f64> = phases
                    .iter()
                    .map(|p| p.named()[i].1.as_secs_f64() * 1e3)
                    .collect();
                v.sort_by(|a, b| a.total_cmp(b));
                (names[i], (pct(&v, 0.5), pct(&v, 0.9)))
            })
            .collect();
        let cells: Vec<String> = cols
            .iter()
            .map(|(_, (a, b))| format!("{:>17}", format!("{a:.2} / {b:.2}")))
            .collect();
        println!("{n:>6} {}", cells.join(" "));
        let fields: Vec<String> = cols
            .iter()
            .map(|(k, (a, b))| format!("\"{k}_p50_ms\":{a:.3},\"{k}_p90_ms\":{b:.3}"))
            .collect();
        json.push(format!("{{\"n\":{n},{}}}", fields.join(",")));
    }
    json
}
