//! `tine restore`: resume a VM from a snapshot directory in this process.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Result};
use tine_vmm::host::KvmFlavor;
use tine_vmm::vm::RestoreOptions;
use tine_vmm::Vm;

use crate::run::report_exit;
use tine_host::console::open_console;

#[derive(clap::Args)]
pub struct RestoreArgs {
    /// Snapshot directory (written by `tine run --snapshot-at ... --snapshot-dir DIR`).
    dir: PathBuf,
    /// Host socket for the snapshot's vsock device.
    #[arg(long)]
    vsock: Option<PathBuf>,
    /// Write the serial console to this file instead of standard output.
    #[arg(long)]
    console: Option<PathBuf>,
    #[arg(long)]
    allow_pvm: bool,
    #[arg(short, long)]
    quiet: bool,
    /// Deliver virtio queue notifications as MMIO exits instead of KVM ioeventfds.
    #[arg(long)]
    no_ioeventfd: bool,
}

pub fn run(a: RestoreArgs) -> Result<i32> {
    let started = Instant::now();
    if KvmFlavor::detect() == KvmFlavor::Pvm && !a.allow_pvm {
        bail!("this host's /dev/kvm is PVM: a Linux guest cannot run here; use `tine lab -- tine restore ...` (or --allow-pvm)");
    }
    let vm = Vm::restore_with(
        &a.dir,
        RestoreOptions {
            console: open_console(a.console.as_deref())?,
            vsock_uds: a.vsock,
            tap: None,
        },
        tine_vmm::VmOptions {
            ioeventfd: !a.no_ioeventfd,
        },
    )?;
    let restored = started.elapsed();
    let running = vm.start()?;
    if !a.quiet {
        eprintln!(
            "[tine] restored in {:.2} ms",
            restored.as_secs_f64() * 1000.0
        );
    }
    let exit = running.wait()?;
    report_exit(a.quiet, exit, started);
    Ok(exit.exit_code())
}
