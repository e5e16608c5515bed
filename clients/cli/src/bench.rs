//! `tine bench ...`: measurements printed as tables (and JSON), never asserted.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tine_image::BOOT_MARKER;

use crate::defaults;

#[derive(clap::Subcommand)]
pub enum BenchCommand {
    /// Cold boot: time from starting the VMM process to the guest's boot marker on the serial
    /// console, and to the VMM's exit after the guest powers off.
    Boot(BootBench),
    /// Guest agent: ping, exec round trip and warm eval latency beside a cold interpreter.
    Agent(tine_agent::bench::BenchArgs),
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
        BenchCommand::Agent(a) => tine_agent::bench::run(&a).map(|()| 0),
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
