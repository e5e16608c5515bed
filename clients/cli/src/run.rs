//! `tine run`: boot a VM and stream its serial console; the exit status says how the guest ended.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use tine_vmm::host::KvmFlavor;
use tine_vmm::{GuestRam, LinuxBoot, Vm, DEFAULT_CMDLINE};

use crate::defaults;

#[derive(clap::Args)]
pub struct RunArgs {
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
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256)]
    mem_mib: u64,
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
    /// Try to boot even on a PVM host (stock kernels will not get far).
    #[arg(long)]
    allow_pvm: bool,
    /// Print nothing but the guest console.
    #[arg(short, long)]
    quiet: bool,
}

/// Console writer that pushes every write straight out, so a reader sees output as it happens.
struct Unbuffered<W: Write>(W);

impl<W: Write> Write for Unbuffered<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.0.write(buf)?;
        if buf.contains(&b'\n') {
            self.0.flush()?;
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush()
    }
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
    let kernel = match a.kernel {
        Some(k) => k,
        None => defaults::kernel()?,
    };
    let initrd = match a.initrd {
        Some(i) => i,
        None => defaults::smoke_initrd()?,
    };
    let cmdline = match (a.cmdline, a.append) {
        (Some(c), _) => c,
        (None, Some(extra)) => format!("{DEFAULT_CMDLINE} {extra}"),
        (None, None) => DEFAULT_CMDLINE.to_string(),
    };
    let console: Box<dyn Write + Send> = match &a.console {
        Some(p) => Box::new(Unbuffered(
            std::fs::File::create(p).with_context(|| format!("creating {}", p.display()))?,
        )),
        None => Box::new(Unbuffered(std::io::stdout())),
    };

    let ram = GuestRam::new_memfd(a.mem_mib)?;
    let mut vm = Vm::create(a.vcpus, ram, console)?;
    if let Some(path) = &a.vsock {
        vm.add_vsock(a.cid, path)?;
    }
    let entry = vm.load_linux(&LinuxBoot {
        kernel,
        initrd: Some(initrd),
        cmdline,
    })?;
    tracing::info!(?entry, setup = ?started.elapsed(), "VM ready to run");
    let exit = vm.run()?;
    if !a.quiet {
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
    Ok(exit.exit_code())
}
