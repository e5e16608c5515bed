//! `tine run`: boot a VM and stream its serial console; the exit status says how the guest ended.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tine_vmm::host::KvmFlavor;
use tine_vmm::{GuestRam, LinuxBoot, Vm, DEFAULT_CMDLINE};

use crate::defaults;
use tine_host::console::open_console;

#[derive(clap::Args)]
pub struct RunArgs {
    /// A guest image built by `tine image build` (name, id or directory): its kernel,
    /// initramfs, command line and memory size are the defaults.
    #[arg(long, conflicts_with_all = ["kernel", "initrd"])]
    image: Option<String>,
    /// Guest kernel: an ELF vmlinux (booted through its PVH entry) or a bzImage.
    /// Default: the Debian cloud kernel from the cache (fetched on first use).
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// Initramfs. Default: the smoke image that prints a marker and powers off.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Replace the whole kernel command line.
    #[arg(long, conflicts_with = "append")]
    cmdline: Option<String>,
    /// Add to the default kernel command line.
    #[arg(long)]
    append: Option<String>,
    /// Guest memory in MiB (default: the image's recommendation, else 256).
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Write the serial console to this file instead of standard output.
    #[arg(long)]
    console: Option<PathBuf>,
    /// Give the guest a virtio-vsock device whose host side is this Unix socket
    /// (`CONNECT <port>` to reach a guest port; guest connections to host port P go to `<path>_P`).
    #[arg(long)]
    vsock: Option<PathBuf>,
    /// The guest's vsock context id.
    #[arg(long, default_value_t = 3)]
    cid: u64,
    /// Take a snapshot of the VM into --snapshot-dir as soon as this text appears on its
    /// console, then stop the VM.
    #[arg(long, requires = "snapshot_dir")]
    snapshot_at: Option<String>,
    /// Where --snapshot-at writes the snapshot (must not exist).
    #[arg(long, requires = "snapshot_at")]
    snapshot_dir: Option<PathBuf>,
    /// Try to boot even on a PVM host (stock kernels will not get far).
    #[arg(long)]
    allow_pvm: bool,
    /// Print nothing but the guest console.
    #[arg(short, long)]
    quiet: bool,
    /// Deliver virtio queue notifications as MMIO exits to the VMM instead of through KVM
    /// ioeventfds (to compare the two).
    #[arg(long)]
    no_ioeventfd: bool,
    /// When the guest stops, write KVM's counters for the VM (exits by reason, page faults,
    /// halts, summed over vCPUs; the VM's own under `vm.`) to this file as a JSON object.
    #[arg(long)]
    kvm_counters: Option<PathBuf>,
}

pub fn run(a: RunArgs) -> Result<i32> {
    let started = Instant::now();
    let flavor = KvmFlavor::detect();
    if flavor == KvmFlavor::Pvm && !a.allow_pvm {
        bail!(
            "this host's /dev/kvm is PVM (kvm_pvm): guest ring 0 is emulated and a stock Linux \
             kernel cannot boot. Run on a host with VMX/SVM, or inside the nested lab: \
             `tine lab -- tine run ...` (or pass --allow-pvm to try anyway)"
        );
    }
    let image = a
        .image
        .as_deref()
        .map(|name| tine_image::load_image_in(&crate::local::image_cache(), name))
        .transpose()
        .context("loading the image")?;
    let (kernel, initrd) = match &image {
        Some(m) => (m.kernel_path(), m.initrd_path()),
        None => (
            match a.kernel {
                Some(k) => k,
                None => defaults::kernel()?,
            },
            match a.initrd {
                Some(i) => i,
                None => defaults::smoke_initrd()?,
            },
        ),
    };
    let base = match &image {
        Some(m) if !m.cmdline_append.is_empty() => {
            format!("{DEFAULT_CMDLINE} {}", m.cmdline_append)
        }
        _ => DEFAULT_CMDLINE.to_string(),
    };
    let cmdline = match (a.cmdline, a.append) {
        (Some(c), _) => c,
        (None, Some(extra)) => format!("{base} {extra}"),
        (None, None) => base,
    };
    let mem_mib = a
        .mem_mib
        .or(image.as_ref().map(|m| m.memory_mib as u64))
        .unwrap_or(256);
    let console = open_console(a.console.as_deref())?;
    let (console, marker_seen) = match &a.snapshot_at {
        Some(m) => {
            let (w, rx) = MarkerWatch::new(console, m.as_bytes());
            (Box::new(w) as Box<dyn Write + Send>, Some(rx))
        }
        None => (console, None),
    };

    let ram = GuestRam::new_memfd(mem_mib)?;
    let mut vm = Vm::create_with(
        a.vcpus,
        ram,
        console,
        tine_vmm::VmOptions {
            ioeventfd: !a.no_ioeventfd,
        },
    )?;
    if let Some(path) = &a.vsock {
        vm.add_vsock(a.cid, path)?;
    }
    let entry = vm.load_linux(&LinuxBoot {
        kernel,
        initrd: Some(initrd),
        cmdline,
    })?;
    tracing::info!(?entry, setup = ?started.elapsed(), "VM ready to run");
    let running = vm.start()?;
    if let (Some(rx), Some(dir)) = (marker_seen, &a.snapshot_dir) {
        if rx.recv().is_ok() {
            let t0 = Instant::now();
            let header = running.snapshot(dir)?;
            let took = t0.elapsed();
            running.stop();
            eprintln!(
                "[tine] snapshot of {} vCPU(s), {} MiB written to {} in {:.1} ms",
                header.vcpus,
                header.mem_size >> 20,
                dir.display(),
                took.as_secs_f64() * 1000.0
            );
            return Ok(0);
        }
        // The console closed without the marker: the guest stopped; report how.
    }
    let exit = running.wait_exit()?;
    if let Some(path) = &a.kvm_counters {
        // The guest ran; not having its counters must not turn that into a failure.
        match running.kvm_counters() {
            Some(counters) => std::fs::write(path, serde_json::to_vec(&counters)?)
                .with_context(|| format!("writing {}", path.display()))?,
            None => eprintln!(
                "warning: no KVM counters written to {}: this host's KVM has no statistics \
                 files (Linux 5.14 or later)",
                path.display()
            ),
        }
    }
    drop(running);
    report_exit(a.quiet, exit, started);
    Ok(exit.exit_code())
}

pub fn report_exit(quiet: bool, exit: tine_vmm::GuestExit, started: Instant) {
    if !quiet {
        eprintln!(
            "[tine] guest {} (exit {}) after {:.3} s",
            match exit {
                tine_vmm::GuestExit::PowerOff => "powered off",
                tine_vmm::GuestExit::Reboot => "rebooted",
                tine_vmm::GuestExit::TripleFault => "crashed (triple fault)",
            },
            exit.exit_code(),
            started.elapsed().as_secs_f64()
        );
    }
}

/// Passes console output through and reports (once) when a marker string has gone by.
struct MarkerWatch {
    inner: Box<dyn Write + Send>,
    marker: Vec<u8>,
    tail: Vec<u8>,
    tx: Option<std::sync::mpsc::Sender<()>>,
}

impl MarkerWatch {
    fn new(inner: Box<dyn Write + Send>, marker: &[u8]) -> (Self, std::sync::mpsc::Receiver<()>) {
        let (tx, rx) = std::sync::mpsc::channel();
        (
            Self {
                inner,
                marker: marker.to_vec(),
                tail: Vec::new(),
                tx: Some(tx),
            },
            rx,
        )
    }
}

impl Write for MarkerWatch {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        if self.tx.is_some() {
            self.tail.extend_from_slice(&buf[..n]);
            if self
                .tail
                .windows(self.marker.len())
                .any(|w| w == self.marker)
            {
                if let Some(tx) = self.tx.take() {
                    let _ = tx.send(());
                }
            }
            let keep = self.marker.len().saturating_sub(1);
            if self.tail.len() > keep {
                self.tail.drain(..self.tail.len() - keep);
            }
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}
