//! `tine bench ...`: measurements printed as tables (and JSON), never asserted.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tine_host::{SpawnOptions, SpawnOutcome, SpawnPhases};
use tine_image::BOOT_MARKER;
use tine_vmm::kvm_stats::Counters;

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
    /// Bursts as an executor daemon serves them: its pools (VMM workers, child networks) of
    /// a set size, refilled and grown in the background, several bursts of N in a row.
    Burst(crate::bench_burst::BurstBench),
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
        BenchCommand::Burst(b) => crate::bench_burst::run(b),
    }
}

struct Sample {
    to_marker: Duration,
    to_exit: Duration,
    /// KVM's counters for the whole boot (None: this host's KVM has none).
    kvm: Option<Counters>,
}

fn one_boot(kernel: &PathBuf, initrd: &PathBuf, vcpus: u8, mem_mib: u64) -> Result<Sample> {
    let exe = std::env::current_exe().context("locating the tine binary")?;
    let counters = tempfile::NamedTempFile::new().context("a file for KVM's counters")?;
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
        .arg("--kvm-counters")
        .arg(counters.path())
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
    let kvm = std::fs::read(counters.path())
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    Ok(Sample {
        to_marker,
        to_exit,
        kvm,
    })
}

/// The counters a boot table shows first, in this order (the rest follow by name): exits and
/// what they were for.
const LEADING_COUNTERS: [&str; 9] = [
    "exits",
    "pf_taken",
    "halt_exits",
    "io_exits",
    "mmio_exits",
    "irq_exits",
    "irq_window_exits",
    "insn_emulation",
    "hypercalls",
];

/// Per counter, its p50 over each column's samples; rows where every column is 0 are left
/// out. Columns without counters are None.
fn counter_table(columns: &[Vec<&Counters>]) -> Vec<(String, Vec<Option<u64>>)> {
    let mut names: Vec<String> = columns
        .iter()
        .flatten()
        .flat_map(|c| c.0.keys().cloned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let rank = |n: &str| {
        LEADING_COUNTERS
            .iter()
            .position(|l| *l == n)
            .unwrap_or(LEADING_COUNTERS.len())
    };
    names.sort_by(|a, b| rank(a).cmp(&rank(b)).then(a.cmp(b)));
    names
        .into_iter()
        .map(|n| {
            let row: Vec<Option<u64>> = columns
                .iter()
                .map(|samples| {
                    let mut v: Vec<u64> = samples.iter().map(|c| c.get(&n)).collect();
                    v.sort_unstable();
                    v.get(v.len() / 2).copied()
                })
                .collect();
            (n, row)
        })
        .filter(|(_, row)| row.iter().any(|v| v.unwrap_or(0) > 0))
        .collect()
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
    let mut all_samples = Vec::new();
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
        let kvm: Vec<&Counters> = samples.iter().filter_map(|s| s.kvm.as_ref()).collect();
        let kvm_json = counter_table(&[kvm])
            .into_iter()
            .map(|(n, v)| format!("{n:?}:{}", v[0].unwrap_or(0)))
            .collect::<Vec<_>>()
            .join(",");
        json.push(format!(
            "{{\"kernel\":{:?},\"runs\":{},\"marker_ms\":{{\"min\":{min:.3},\"p50\":{p50:.3},\"max\":{max:.3}}},\"exit_ms_p50\":{exit_p50:.3},\"kvm_p50\":{{{kvm_json}}}}}",
            name, b.runs
        ));
        all_samples.push((name, samples));
    }
    print_kvm_counters(&all_samples);
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

/// Print [`counter_table`] of `columns` under `headers`, `width` characters a column; returns
/// the table.
fn print_counter_table(
    headers: &[String],
    columns: &[Vec<&Counters>],
    width: usize,
) -> Vec<(String, Vec<Option<u64>>)> {
    print!("{:<32}", "counter");
    for h in headers {
        print!(" {h:>width$}");
    }
    println!();
    let table = counter_table(columns);
    for (name, row) in &table {
        print!("{name:<32}");
        for v in row {
            match v {
                Some(v) => print!(" {v:>width$}"),
                None => print!(" {:>width$}", "-"),
            }
        }
        println!();
    }
    table
}

/// KVM's counters per boot, one column per kernel: where a boot's exits went.
fn print_kvm_counters(runs: &[(String, Vec<Sample>)]) {
    let columns: Vec<Vec<&Counters>> = runs
        .iter()
        .map(|(_, s)| s.iter().filter_map(|s| s.kvm.as_ref()).collect())
        .collect();
    if columns.iter().all(Vec::is_empty) {
        println!(
            "\nKVM counters: not available on this host (KVM statistics files need Linux 5.14)"
        );
        return;
    }
    println!(
        "\nKVM counters per boot (p50 over the runs; counted by KVM, so exits it handles itself, \
         such as nested page faults (pf_taken) and halts, are included; vm.* are the VM's own \
         at its end, e.g. guest memory mapped by page size)"
    );
    let headers: Vec<String> = runs
        .iter()
        .map(|(n, _)| truncate(n, 20).to_string())
        .collect();
    print_counter_table(&headers, &columns, 20);
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
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
    /// Seconds the children idle once all are ready, before their memory is read.
    #[arg(long, default_value_t = 0.5)]
    idle_secs: f64,
    /// Children of each fan-out whose written pages are attributed to causes in the guest
    /// (needs python3 in the image; 0: none).
    #[arg(long, default_value_t = 2)]
    attribute: usize,
    /// Hold the snapshot's memory in huge pages before the first fan-out, and restore every
    /// child from that copy (as an executor does for a hot snapshot; see docs/performance.md).
    #[arg(long)]
    hold_image: bool,
    /// Open the children's guest RAM to the host's page merging (KSM), as `tine up
    /// --merge-pages` does, and report what merged and the KSM daemon's CPU time (needs
    /// /sys/kernel/mm/ksm/run = 1; give --idle-secs long enough for its passes).
    #[arg(long)]
    merge_pages: bool,
    /// Do not prime idle VMM workers for the snapshot spawned from (each child then loads
    /// the snapshot and maps its working set after its job arrives; see docs/performance.md).
    #[arg(long)]
    no_prime: bool,
    /// Seconds after each child's guest starts to give back the guest RAM pages its VMM holds
    /// unchanged from the snapshot (written back as they were, or copied ahead with the working
    /// set and never changed), inside one short pause; 0: never.
    #[arg(long, default_value_t = 2.0, value_parser = crate::local::parse_give_back_after)]
    give_back_after: f64,
    /// How VMM workers are started: fork (from a zygote that loaded the worker program once,
    /// so workers share the pages its loading wrote: about 0.15 MiB less per child) or exec
    /// (each from the program, with an address-space layout of its own).
    #[arg(long, default_value_t = tine_host::WorkerStart::Fork)]
    worker_start: tine_host::WorkerStart,
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
    smaps_of(pid).map(|s| pss_split(&s))
}

fn smaps_of(pid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()
}

/// [`pss_split_kib`] of smaps text already read.
fn pss_split(s: &str) -> (u64, u64) {
    let (mut guest, mut vmm) = (0u64, 0u64);
    tine_host::smaps::for_each_field(s, |path, field, kib| {
        if field == "Pss:" {
            if tine_host::hot::is_guest_ram(path) {
                guest += kib;
            } else {
                vmm += kib;
            }
        }
    });
    (guest, vmm)
}

/// A process's private memory in KiB from its smaps text (`Private_Clean` + `Private_Dirty`
/// of every mapping): what it holds that no other process maps, so what ending it would give
/// back.
fn private_kib(s: &str) -> u64 {
    let mut kib = 0u64;
    tine_host::smaps::for_each_field(s, |_, field, k| {
        if field == "Private_Clean:" || field == "Private_Dirty:" {
            kib += k;
        }
    });
    kib
}

/// A scratch data directory for one benchmark run, inside the data directory (made first
/// if this machine has none yet); removed when dropped.
pub(crate) fn scratch_dir(data_dir: &std::path::Path, prefix: &str) -> Result<tempfile::TempDir> {
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("making the data directory {}", data_dir.display()))?;
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(data_dir)
        .with_context(|| format!("making a scratch directory in {}", data_dir.display()))
}

/// Boot `image` as a one-vCPU parent on `host`, snapshot it as `tag`, and say how long that
/// took (`what`: how the parent is described, e.g. "booted with a network interface").
pub(crate) fn boot_parent(
    host: &tine_host::Host,
    image: &str,
    tag: &tine_proto::names::Tag,
    what: &str,
) -> Result<()> {
    let t = Instant::now();
    host.create_snapshot(&tine_host::ParentSpec {
        image: tine_image::ImageRef::Local(image.to_string()),
        tag: tag.clone(),
        vcpus: 1,
        mem_mib: None,
        evals: Vec::new(),
        ready_timeout: None,
        replace: false,
    })?;
    println!(
        "parent {image} {what} and snapshotted in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Busy CPU time of the whole machine so far, in ms, from /proc/stat (every CPU: user, nice,
/// system, irq, softirq, steal; a guest's time is inside user). None where it cannot be read.
pub(crate) fn machine_busy_ms() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal ...
    let busy = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)? + f.get(7)?;
    tine_host::process::ticks_to_ms(busy)
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
    // Polled gently (backing off to 100 ms): each ping of a warming guest is work its
    // warm-up competes with, and a 1 ms period made lab cold boots 1.1-1.7x slower than the
    // same boot polled this way (docs/performance.md, "Beside Firecracker"). The agent says
    // how long it has been ready, so the backoff does not blur the figure.
    let client = tine_host::ready::agent(&sock);
    let r = client.wait_ready(Duration::from_secs(900));
    let answered = start.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let ping = r.context("cold boot never became ready")?;
    Ok(cold_ready_at(answered, ping.ready_for))
}

/// When a cold boot became ready: when its agent answered ready, less how long it said it
/// had been, at most two of the poll's longest periods (so a guest cannot move the figure
/// further than its polling could); an agent that does not say leaves the answer's time.
fn cold_ready_at(answered: Duration, ready_for: Option<Duration>) -> Duration {
    let at_most = 2 * tine_agent::client::WAIT_READY_MAX_PERIOD;
    answered.saturating_sub(ready_for.unwrap_or_default().min(at_most))
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
    if !(0.0..=3600.0).contains(&b.idle_secs) {
        bail!("--idle-secs must be between 0 and 3600");
    }
    println!(
        "fork benchmark: snapshot {:?}, image {:?}",
        b.tag.as_str(),
        b.image
    );
    let worker = crate::local::worker_exe()?;
    let worker = worker.file_name().map_or_else(
        || worker.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    println!("how: each child = one VMM process (a `{worker} __vmm-worker` pre-started before the clock) handed the snapshot, restoring it (guest RAM mapped MAP_PRIVATE);");
    println!("     ready = its guest agent answered a ping over vsock and took the host's clock and fresh entropy;");
    println!("     per-child time runs from handing its worker the snapshot; total = wall time until all N are ready (--parallel {}: at most that many restoring at once, 0 = all);", b.parallel);
    println!("     cold = `tine run --image` to agent ready (polled backing off to 100 ms, less how long the agent says it had been ready);");
    println!(
        "     memory = PSS of the child VMM processes after all are ready and idle for {} s, divided by N, split into guest RAM (the memory.img mapping: shared pages by share, pages the guest wrote in full) and the VMM process itself;",
        b.idle_secs
    );
    println!("     CPU/child = the whole machine's busy CPU time in ms (/proc/stat, all CPUs, counted at clock-tick resolution) from the clock until all N are ready, divided by N;");
    match crate::local::give_back_after(b.give_back_after) {
        Some(d) => println!("     each child's VMM gives back the guest pages it holds unchanged from the snapshot {:.1} s after its guest starts (--give-back-after; 0: never).", d.as_secs_f64()),
        None => println!("     no child gives back the guest pages it holds unchanged (--give-back-after 0)."),
    }
    match b.worker_start {
        tine_host::WorkerStart::Fork => println!("     VMM workers are forked from a zygote that loaded the worker program once (--worker-start fork)."),
        tine_host::WorkerStart::Exec => println!("     VMM workers are each started from the worker program (--worker-start exec)."),
    }
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
        "\n{:>6} {:>12} {:>10} {:>10} {:>10} {:>12} {:>12} {:>10} {:>10} {:>10} {:>8}",
        "N",
        "total ms",
        "p50 ms",
        "p90 ms",
        "max ms",
        "vs cold p50",
        "CPU/child ms",
        "MiB/child",
        "guest RAM",
        "VMM",
        "failed"
    );
    let mut rows = Vec::new();
    let mut phase_rows: Vec<(usize, Vec<SpawnPhases>)> = Vec::new();
    let mut written_rows: Vec<(usize, Written)> = Vec::new();
    let mut counter_rows: Vec<(usize, Vec<Counters>)> = Vec::new();
    let host = tine_host::Host::open(crate::local::host_config(
        tine_host::Owner::Cli,
        tine_host::Limits {
            merge_pages: b.merge_pages,
            prime_workers: !b.no_prime,
            give_back_after: crate::local::give_back_after(b.give_back_after),
            worker_start: b.worker_start,
            ..tine_host::Limits::one_shot()
        },
        tine_host::Readiness::Agent,
    )?)?;
    if b.merge_pages {
        let setting = |f: &str| {
            std::fs::read_to_string(std::path::Path::new(tine_host::ksm::SYSFS).join(f))
                .map_or("?".into(), |v| v.trim().to_string())
        };
        println!(
            "page merging (KSM) on: children's guest RAM advised MADV_MERGEABLE; ksmd pages_to_scan {}, sleep_millisecs {}, use_zero_pages {}",
            setting("pages_to_scan"),
            setting("sleep_millisecs"),
            setting("use_zero_pages")
        );
    }
    if b.hold_image {
        let t = Instant::now();
        let bytes = host.hold_image(&b.tag)?;
        println!(
            "held image: {:.1} MiB of the snapshot's memory copied into huge-page shared memory in {:.1} ms (before the clock)",
            bytes as f64 / (1u64 << 20) as f64,
            t.elapsed().as_secs_f64() * 1e3
        );
    }
    let opts = SpawnOptions {
        ready_timeout: Some(Duration::from_secs(300)),
        parallel: b.parallel,
        readiness: None,
        layer: None,
        fetch: None,
        network: None,
        resources: Default::default(),
    };
    let mut merge_rows: Vec<Merged> = Vec::new();
    let mut idle_rows: Vec<IdleWorkers> = Vec::new();
    let mut slab_rows: Vec<crate::bench_slab::Row> = Vec::new();
    for &n in &b.counts {
        // Before the workers: each one's VM is made as it starts.
        let waiting_before = host.idle_worker_pids().len();
        let slab0 = crate::bench_slab::Slab::read();
        // Workers up and waiting before the clock (fork_children finds them there).
        host.prestart_workers_for(&b.tag, n)?;
        idle_rows.push(idle_workers(&host, &b.tag, n));
        let ksm0 = b.merge_pages.then(Merged::before);
        let t0 = Instant::now();
        let busy0 = machine_busy_ms();
        let collected = std::sync::Mutex::new(Vec::new());
        // KVM's counters of the first children ready, read as each becomes ready: what its
        // VM did from creation to ready (one control-socket call each, after its clock).
        let counted = std::sync::Mutex::new(Vec::new());
        let slots = std::sync::atomic::AtomicUsize::new(0);
        crate::fork::fork_children(&host, &b.tag, n, &opts, |r| {
            use std::sync::atomic::Ordering::Relaxed;
            if r.result.is_ok() && slots.fetch_add(1, Relaxed) < b.attribute {
                match host.kvm_counters(&r.id) {
                    Ok(Some(c)) => counted.lock().unwrap().push(c),
                    Ok(None) => {}
                    Err(e) => eprintln!("  child {}: {e}", r.id),
                }
            }
            collected.lock().unwrap().push(r)
        })?;
        let reports: Vec<SpawnOutcome> = collected.into_inner().unwrap();
        counter_rows.push((n, counted.into_inner().unwrap()));
        let total = t0.elapsed().as_secs_f64() * 1e3;
        let cpu_per_child = busy0
            .zip(machine_busy_ms())
            .map(|(a, b)| (b - a) / n as f64);
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
        std::thread::sleep(Duration::from_secs_f64(b.idle_secs)); // let children go idle
        slab_rows.push(crate::bench_slab::Row {
            n,
            waiting_before,
            growth: slab0
                .zip(crate::bench_slab::Slab::read())
                .map(|(before, now)| now.growth_per_child(&before, n)),
        });
        let split: Vec<(u64, u64)> = reports
            .iter()
            .filter_map(|r| r.pid.and_then(pss_split_kib))
            .collect();
        if let Some(before) = &ksm0 {
            let pids: Vec<u32> = reports.iter().filter_map(|r| r.pid).collect();
            merge_rows.push(before.after(n, &pids));
        }
        let guest_kib: u64 = split.iter().map(|s| s.0).sum();
        let vmm_kib: u64 = split.iter().map(|s| s.1).sum();
        let mib_per_child = (guest_kib + vmm_kib) as f64 / 1024.0 / n as f64;
        let guest_mib = guest_kib as f64 / 1024.0 / n as f64;
        let vmm_mib = vmm_kib as f64 / 1024.0 / n as f64;
        // After the PSS: running the classifier in a child writes pages of its own.
        let sample: Vec<&SpawnOutcome> = reports
            .iter()
            .filter(|r| r.result.is_ok() && r.pid.is_some())
            .take(b.attribute)
            .collect();
        if !sample.is_empty() {
            written_rows.push((n, attribute_written(&host, &sample)));
        }
        for r in &reports {
            let _ = host.kill(&r.id);
        }
        if ready.is_empty() {
            println!(
                "{n:>6} {total:>12.1} {:>10} {:>10} {:>10} {:>12} {:>12} {:>10} {:>10} {:>10} {failed:>8}",
                "-", "-", "-", "-", "-", "-", "-", "-"
            );
            continue;
        }
        let (p50, p90, max) = (pct(&ready, 0.5), pct(&ready, 0.9), ready[ready.len() - 1]);
        // Spawning N from a snapshot vs cold-booting N (one at a time, as measured).
        let ratio = (cold_p50 * n as f64) / total;
        let cpu_cell = cpu_per_child.map_or("-".to_string(), |c| format!("{c:.1}"));
        let cpu_json = cpu_per_child.map_or("null".to_string(), |c| format!("{c:.1}"));
        println!("{n:>6} {total:>12.1} {p50:>10.1} {p90:>10.1} {max:>10.1} {ratio:>11.1}x {cpu_cell:>12} {mib_per_child:>10.2} {guest_mib:>10.2} {vmm_mib:>10.2} {failed:>8}");
        rows.push(format!(
            "{{\"n\":{n},\"total_ms\":{total:.3},\"p50_ms\":{p50:.3},\"p90_ms\":{p90:.3},\"max_ms\":{max:.3},\"ratio_vs_cold\":{ratio:.2},\"cpu_ms_per_child\":{cpu_json},\"mib_per_child\":{mib_per_child:.3},\"guest_ram_mib_per_child\":{guest_mib:.3},\"vmm_mib_per_child\":{vmm_mib:.3},\"failed\":{failed}}}"
        ));
    }
    println!("\n`vs cold p50` = N x (cold boot p50) / (wall time to get all N children ready).");
    let idle_json = print_idle_workers(&idle_rows);
    let phases_json = print_phase_table(&phase_rows);
    let written_json = print_written_table(&written_rows, b.idle_secs);
    let slab_json = crate::bench_slab::print_table(&slab_rows);
    let counters_json = print_child_counters(&counter_rows);
    let merged_json = if b.merge_pages {
        print_merged_table(&merge_rows, b.idle_secs)
    } else {
        "null".to_string()
    };
    let doc = format!(
        "{{\"bench\":\"fork\",\"tag\":{:?},\"cold_ready_ms_p50\":{cold_p50:.3},\"kvm_floor_ms_p50\":{:.3},\"idle_secs\":{},\"hold_image\":{},\"merge_pages\":{},\"prime_workers\":{},\"give_back_after_secs\":{},\"worker_start\":\"{}\",\"idle_workers\":[{}],\"rows\":[{}],\"phases\":[{}],\"written\":{},\"slab_by_cache\":{},\"kvm_to_ready_p50\":{},\"merged\":{}}}",
        b.tag.as_str(),
        pct(&floor, 0.5),
        b.idle_secs,
        b.hold_image,
        b.merge_pages,
        !b.no_prime,
        b.give_back_after,
        b.worker_start,
        idle_json.join(","),
        rows.join(","),
        phases_json.join(","),
        written_json,
        slab_json,
        counters_json,
        merged_json
    );
    println!("json: {doc}");
    if let Some(p) = b.json {
        std::fs::write(&p, &doc).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(0)
}

/// The workers waiting before one N's clock: how many, how many primed for the snapshot, and
/// their PSS and private memory (what an idle worker costs the host while it waits; a primed
/// one holds the pages its working set's copies wrote).
struct IdleWorkers {
    n: usize,
    idle: usize,
    primed: usize,
    guest_kib: u64,
    vmm_kib: u64,
    private_kib: u64,
}

fn idle_workers(host: &tine_host::Host, tag: &tine_proto::names::Tag, n: usize) -> IdleWorkers {
    // Each worker's smaps read once, for both figures.
    let read: Vec<((u64, u64), u64)> = host
        .idle_worker_pids()
        .into_iter()
        .filter_map(smaps_of)
        .map(|s| (pss_split(&s), private_kib(&s)))
        .collect();
    IdleWorkers {
        n,
        idle: read.len(),
        primed: host.primed_workers(tag),
        guest_kib: read.iter().map(|r| r.0 .0).sum(),
        vmm_kib: read.iter().map(|r| r.0 .1).sum(),
        private_kib: read.iter().map(|r| r.1).sum(),
    }
}

/// Prints the idle workers of each N (PSS per worker, before the clock); returns JSON rows.
fn print_idle_workers(rows: &[IdleWorkers]) -> Vec<String> {
    println!("\nidle workers before the clock, per worker (MiB): PSS = guest RAM mapped while primed + the VMM process; private = pages no other process maps:");
    println!(
        "{:>6} {:>6} {:>8} {:>10} {:>10} {:>10} {:>10}",
        "N", "idle", "primed", "PSS", "guest RAM", "VMM", "private"
    );
    rows.iter()
        .map(|r| {
            let per = |kib: u64| kib as f64 / 1024.0 / r.idle.max(1) as f64;
            let (g, v, p) = (per(r.guest_kib), per(r.vmm_kib), per(r.private_kib));
            println!(
                "{:>6} {:>6} {:>8} {:>10.2} {:>10.2} {:>10.2} {:>10.2}",
                r.n,
                r.idle,
                r.primed,
                g + v,
                g,
                v,
                p
            );
            format!(
                "{{\"n\":{},\"idle\":{},\"primed\":{},\"guest_ram_mib_per_worker\":{g:.3},\"vmm_mib_per_worker\":{v:.3},\"private_mib_per_worker\":{p:.3}}}",
                r.n, r.idle, r.primed
            )
        })
        .collect()
}

/// KVM's counters per child from its VM's creation to ready, one column per N; returns them
/// as JSON (`{"N": {counter: p50}}`).
fn print_child_counters(rows: &[(usize, Vec<Counters>)]) -> String {
    let columns: Vec<Vec<&Counters>> = rows.iter().map(|(_, c)| c.iter().collect()).collect();
    if columns.iter().all(Vec::is_empty) {
        println!("\nKVM counters: none read (this host's KVM keeps none, or --attribute 0)");
        return "{}".into();
    }
    println!(
        "\nKVM counters per child from restore to ready (p50 over the first children ready, as \
         many as --attribute; read as each became ready; pf_taken = nested page faults, e.g. \
         first touches of guest RAM)"
    );
    let headers: Vec<String> = rows
        .iter()
        .map(|(n, c)| format!("N={n} ({})", c.len()))
        .collect();
    let table = print_counter_table(&headers, &columns, 16);
    let per_n: Vec<String> = rows
        .iter()
        .enumerate()
        .map(|(i, (n, _))| {
            let fields: Vec<String> = table
                .iter()
                .filter_map(|(name, row)| row[i].map(|v| format!("{name:?}:{v}")))
                .collect();
            format!("\"{n}\":{{{}}}", fields.join(","))
        })
        .collect();
    format!("{{{}}}", per_n.join(","))
}

/// The pages a sample of children wrote, summed by cause (guest causes in pages, the VMM's own
/// in KiB), over `children` children.
#[derive(Default)]
struct Written {
    children: usize,
    guest_pages: BTreeMap<String, u64>,
    vmm_kib: BTreeMap<String, u64>,
    /// What the kernel holds for the children, from their cgroups (bytes, summed over
    /// `cgroup_children`), and all their cgroups were charged (`memory.current`).
    kernel_bytes: BTreeMap<String, u64>,
    charged_bytes: u64,
    cgroup_children: usize,
    /// Children whose guest could not say (no python3 in the image, say), with why.
    unattributed: Vec<String>,
}

impl Written {
    /// `bytes` summed over the children with cgroups, in MiB per such child.
    fn mib_per_cgroup_child(&self, bytes: u64) -> f64 {
        bytes as f64 / (1u64 << 20) as f64 / self.cgroup_children.max(1) as f64
    }
}

fn attribute_written(host: &tine_host::Host, sample: &[&SpawnOutcome]) -> Written {
    let mut w = Written::default();
    for r in sample {
        let pid = r.pid.expect("sampled children have a pid");
        let frames = match crate::bench_pages::written_guest_frames(pid) {
            Ok(f) => f,
            Err(e) => {
                w.unattributed.push(format!("{}: {e:#}", r.id));
                continue;
            }
        };
        let vmm = crate::bench_pages::vmm_private_kib(pid).unwrap_or_default();
        let kernel = host
            .cgroup_dir(&r.id)
            .and_then(|d| tine_host::cgroup::kernel_memory(&d));
        let charged = host.usage(&r.id).ok().flatten().map(|u| u.memory_current);
        if let Some((kernel, charged)) = kernel.zip(charged) {
            w.cgroup_children += 1;
            w.charged_bytes += charged;
            for (k, bytes) in kernel {
                *w.kernel_bytes
                    .entry(format!("host kernel: {k}"))
                    .or_default() += bytes;
            }
        }
        let causes = host
            .vm_dir(&r.id)
            .map_err(anyhow::Error::from)
            .and_then(|d| {
                let agent = tine_host::ready::agent(&d.join("vsock.sock"));
                crate::bench_pages::guest_causes(&agent, &frames)
            });
        w.children += 1;
        match causes {
            Ok(c) => {
                for (cause, pages) in c {
                    *w.guest_pages.entry(cause).or_default() += pages;
                }
            }
            Err(e) => {
                w.unattributed.push(format!("{}: {e:#}", r.id));
                *w.guest_pages.entry("not attributed".into()).or_default() += frames.len() as u64;
            }
        }
        for (k, kib) in vmm {
            *w.vmm_kib.entry(k.to_string()).or_default() += kib;
        }
    }
    w
}

/// What the host's page merging did for one fan-out: read before its clock and once its
/// children have idled.
struct Merged {
    n: usize,
    /// Host-wide KSM counters: read before the clock, then (in `after`) their growth since.
    counters: tine_host::ksm::Counters,
    /// Mean over the children of their pages mapped to merged pages (None: none readable).
    merging_per_child: Option<f64>,
    /// The KSM daemon's CPU time: its total before the clock, then its growth since.
    ksmd_ms: Option<f64>,
}

impl Merged {
    fn read_counters() -> tine_host::ksm::Counters {
        tine_host::ksm::Counters::read(std::path::Path::new(tine_host::ksm::SYSFS))
            .unwrap_or_default()
    }

    fn before() -> Merged {
        Merged {
            n: 0,
            counters: Merged::read_counters(),
            merging_per_child: None,
            ksmd_ms: tine_host::ksm::daemon_cpu_ms(),
        }
    }

    fn after(&self, n: usize, pids: &[u32]) -> Merged {
        let merging: Vec<u64> = pids
            .iter()
            .filter_map(|&p| tine_host::ksm::merging_pages(p))
            .collect();
        Merged {
            n,
            counters: Merged::read_counters().since(&self.counters),
            merging_per_child: (!merging.is_empty())
                .then(|| merging.iter().sum::<u64>() as f64 / merging.len() as f64),
            ksmd_ms: self
                .ksmd_ms
                .zip(tine_host::ksm::daemon_cpu_ms())
                .map(|(a, b)| b - a),
        }
    }
}

/// The page-merging table and its JSON.
fn print_merged_table(rows: &[Merged], idle_secs: f64) -> String {
    const MIB_PER_PAGE: f64 = 4096.0 / (1u64 << 20) as f64;
    println!("\npage merging (KSM) once the children idled {idle_secs} s (host-wide counters, growth from the clock; saved = pages_sharing, the mappings that point at a page kept once, plus pages merged with the zero page; ksmd CPU from the clock, at clock-tick resolution):");
    println!(
        "{:>6} {:>16} {:>14} {:>14} {:>12} {:>8} {:>14}",
        "N", "merged/child", "kept once", "saved MiB", "saved/child", "passes", "ksmd CPU ms"
    );
    let mut json = Vec::new();
    for m in rows {
        let c = m.counters;
        let saved = (c.pages_sharing + c.zero_pages) as f64 * MIB_PER_PAGE;
        let per_child = saved / m.n.max(1) as f64;
        let cpu = m.ksmd_ms.map_or("-".into(), |c| format!("{c:.0}"));
        let merging = m
            .merging_per_child
            .map_or("-".into(), |v| format!("{v:.1}"));
        println!(
            "{:>6} {merging:>16} {:>14} {saved:>14.2} {per_child:>12.3} {:>8} {cpu:>14}",
            m.n, c.pages_shared, c.full_scans
        );
        json.push(format!(
            "{{\"n\":{},\"merging_pages_per_child\":{},\"pages_shared\":{},\"pages_sharing\":{},\"zero_pages\":{},\"saved_mib_per_child\":{per_child:.3},\"passes\":{},\"ksmd_cpu_ms\":{}}}",
            m.n,
            m.merging_per_child.map_or("null".into(), |v| format!("{v:.1}")),
            c.pages_shared,
            c.pages_sharing,
            c.zero_pages,
            c.full_scans,
            m.ksmd_ms.map_or("null".into(), |c| format!("{c:.1}"))
        ));
    }
    format!("[{}]", json.join(","))
}

/// What each sampled child wrote, MiB per child by cause with one column per fan-out size;
/// returns the same as a JSON array.
fn print_written_table(rows: &[(usize, Written)], idle_secs: f64) -> String {
    if rows.is_empty() {
        return "[]".into();
    }
    println!("\nmemory each idle child holds privately, by cause (MiB per child; mean over the first children of each N, {idle_secs} s idle, read after the PSS above):");
    println!("  guest = pages of guest RAM the child wrote (its own copies; the rest it shares with the snapshot), named by the guest's");
    println!("  page flags and process page maps (python3 in the child); VMM = the VMM process's private memory besides guest RAM");
    let mib =
        |v: u64, per: usize, unit_kib: u64| v as f64 * unit_kib as f64 / 1024.0 / per.max(1) as f64;
    let mut causes: Vec<String> = Vec::new();
    let mut vmm: Vec<String> = Vec::new();
    let mut kernel: Vec<String> = Vec::new();
    for (_, w) in rows {
        for (names, seen) in [
            (&mut causes, w.guest_pages.keys()),
            (&mut vmm, w.vmm_kib.keys()),
            (&mut kernel, w.kernel_bytes.keys()),
        ] {
            for k in seen {
                if !names.contains(k) {
                    names.push(k.clone());
                }
            }
        }
    }
    // Biggest first, by the last fan-out's figures.
    let last = &rows[rows.len() - 1].1;
    causes.sort_by_key(|c| std::cmp::Reverse(last.guest_pages.get(c).copied().unwrap_or(0)));
    let header: Vec<String> = rows
        .iter()
        .map(|(n, w)| format!("{:>12}", format!("N={n} ({})", w.children)))
        .collect();
    println!("{:<46} {}", "cause", header.join(" "));
    let line = |name: &str, f: &dyn Fn(&Written) -> f64| {
        let cells: Vec<String> = rows
            .iter()
            .map(|(_, w)| format!("{:>12.2}", f(w)))
            .collect();
        println!("{name:<46} {}", cells.join(" "));
    };
    for c in &causes {
        line(&format!("guest: {c}"), &|w| {
            mib(w.guest_pages.get(c).copied().unwrap_or(0), w.children, 4)
        });
    }
    line("guest: total written", &|w| {
        mib(w.guest_pages.values().sum(), w.children, 4)
    });
    for c in &vmm {
        line(c, &|w| {
            mib(w.vmm_kib.get(c).copied().unwrap_or(0), w.children, 1)
        });
    }
    line("VMM: total", &|w| {
        mib(w.vmm_kib.values().sum(), w.children, 1)
    });
    // The kernel's share, where children have cgroups: the same children, read after them.
    if rows.iter().any(|(_, w)| w.cgroup_children > 0) {
        for k in &kernel {
            line(k, &|w| {
                w.mib_per_cgroup_child(w.kernel_bytes.get(k).copied().unwrap_or(0))
            });
        }
        line("host kernel: total", &|w| {
            w.mib_per_cgroup_child(w.kernel_bytes.values().sum())
        });
        line("cgroup: memory.current (all it is charged)", &|w| {
            w.mib_per_cgroup_child(w.charged_bytes)
        });
        println!("  host kernel = the child's cgroup's memory.stat: kernel stacks of its threads, page tables, KVM's page tables");
        println!("  for the guest (sec_pagetables), slab, per-CPU, vmalloc; memory.current also holds the pages above (the snapshot's");
        println!("  shared pages are charged to the executor)");
    } else {
        println!("  (no host kernel figures: the children run without cgroups of their own)");
    }
    for (_, w) in rows {
        for u in &w.unattributed {
            println!("  not attributed: {u}");
        }
    }
    let json: Vec<serde_json::Value> = rows
        .iter()
        .map(|(n, w)| {
            let guest: serde_json::Map<String, serde_json::Value> = w
                .guest_pages
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::json!(mib(*v, w.children, 4))))
                .collect();
            let vmm: serde_json::Map<String, serde_json::Value> = w
                .vmm_kib
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::json!(mib(*v, w.children, 1))))
                .collect();
            let kernel: serde_json::Map<String, serde_json::Value> = w
                .kernel_bytes
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::json!(w.mib_per_cgroup_child(*v))))
                .collect();
            let charged = (w.cgroup_children > 0).then(|| w.mib_per_cgroup_child(w.charged_bytes));
            serde_json::json!({"n": n, "children": w.children, "guest_mib_per_child": guest,
                               "vmm_mib_per_child": vmm, "kernel_mib_per_child": kernel,
                               "cgroup_children": w.cgroup_children,
                               "cgroup_mib_per_child": charged})
        })
        .collect();
    serde_json::Value::Array(json).to_string()
}

/// Where each child's time went: p50 / p90 of every spawn phase per fan-out size, as a table;
/// returns the same figures as JSON objects.
fn print_phase_table(rows: &[(usize, Vec<SpawnPhases>)]) -> Vec<String> {
    println!("\nspawn phases per child (ms, p50 / p90), as the host measured them:");
    println!("  handoff = child record + a pre-started worker handed the snapshot; restore = KVM restore in the worker;");
    println!("  running = vCPUs started + report back; agent = first agent answer (Wake: clock, entropy, identity in one exchange);");
    println!("  fixup = separate clock + reseed calls (only agents from before Wake); tries = Wake connections to the agent until its first answer (p50 / max, ready children)");
    let names = SpawnPhases::default().named().map(|(name, _)| name);
    let header: Vec<String> = names.iter().map(|n| format!("{n:>17}")).collect();
    println!("{:>6} {} {:>9}", "N", header.join(" "), "tries");
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
        let mut tries: Vec<f64> = phases.iter().map(|p| f64::from(p.agent_attempts)).collect();
        tries.sort_by(|a, b| a.total_cmp(b));
        let (tries_p50, tries_max) = (pct(&tries, 0.5), tries[tries.len() - 1]);
        println!(
            "{n:>6} {} {:>9}",
            cells.join(" "),
            format!("{tries_p50} / {tries_max}")
        );
        let mut fields: Vec<String> = cols
            .iter()
            .map(|(k, (a, b))| format!("\"{k}_p50_ms\":{a:.3},\"{k}_p90_ms\":{b:.3}"))
            .collect();
        fields.push(format!(
            "\"agent_attempts_p50\":{tries_p50},\"agent_attempts_max\":{tries_max}"
        ));
        json.push(format!("{{\"n\":{n},{}}}", fields.join(",")));
    }
    json
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(pairs: &[(&str, u64)]) -> Counters {
        Counters(pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect())
    }

    #[test]
    fn a_cold_boot_counts_from_when_its_agent_became_ready_within_the_polls_reach() {
        let ms = Duration::from_millis;
        assert_eq!(cold_ready_at(ms(30_000), Some(ms(70))), ms(29_930));
        // An agent that does not say, or claims more than polling could have missed.
        assert_eq!(cold_ready_at(ms(30_000), None), ms(30_000));
        assert_eq!(cold_ready_at(ms(30_000), Some(ms(25_000))), ms(29_800));
        assert_eq!(cold_ready_at(ms(50), Some(ms(150))), ms(0));
    }

    #[test]
    fn the_counter_table_leads_with_exits_takes_p50s_and_drops_all_zero_rows() {
        let a = [
            counters(&[
                ("exits", 10),
                ("vm.pages_2m", 3),
                ("pf_taken", 5),
                ("zero", 0),
            ]),
            counters(&[
                ("exits", 30),
                ("vm.pages_2m", 1),
                ("pf_taken", 7),
                ("zero", 0),
            ]),
            counters(&[
                ("exits", 20),
                ("vm.pages_2m", 2),
                ("pf_taken", 6),
                ("zero", 0),
            ]),
        ];
        let b = [counters(&[("exits", 4), ("halt_exits", 1)])];
        let table = counter_table(&[a.iter().collect(), b.iter().collect(), Vec::new()]);
        let names: Vec<&str> = table.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["exits", "pf_taken", "halt_exits", "vm.pages_2m"]);
        assert_eq!(table[0].1, [Some(20), Some(4), None]);
        assert_eq!(table[1].1, [Some(6), Some(0), None]);
        assert_eq!(table[3].1, [Some(2), Some(0), None]);
    }
}
