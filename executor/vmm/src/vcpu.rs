//! vCPU threads: one OS thread per vCPU running KVM_RUN, routing exits to the device bus, and a
//! signal-based kick so the VMM can stop every vCPU promptly (also one parked in a guest HLT).

use std::cell::Cell;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use kvm_bindings::kvm_run;
use kvm_ioctls::{VcpuExit, VcpuFd};

use crate::devices::bus::PioBus;
use crate::devices::mmio::MmioBus;
use crate::devices::GuestExit;
use crate::error::{Error, Result};

const KVM_SYSTEM_EVENT_SHUTDOWN: u32 = 1;
const KVM_SYSTEM_EVENT_RESET: u32 = 2;
const KVM_SYSTEM_EVENT_CRASH: u32 = 3;

thread_local! {
    /// This thread's kvm_run page, so the kick signal can set `immediate_exit` and close the
    /// race between checking the stop flag and entering KVM_RUN.
    static KVM_RUN_PTR: Cell<*mut kvm_run> = const { Cell::new(null_mut()) };
}

extern "C" fn kick_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    KVM_RUN_PTR.with(|p| {
        let run = p.get();
        if !run.is_null() {
            // SAFETY: the pointer is this thread's live kvm_run mapping, set while its VcpuFd
            // exists; writing one byte is async-signal-safe.
            unsafe { (*run).immediate_exit = 1 };
        }
    });
}

/// The real-time signal used to kick vCPU threads out of KVM_RUN.
pub fn kick_signal() -> libc::c_int {
    libc::SIGRTMIN()
}

/// Install the kick handler once per process.
pub fn install_kick_handler() -> Result<()> {
    static ONCE: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    ONCE.get_or_init(|| {
        vmm_sys_util::signal::register_signal_handler(kick_signal(), kick_handler)
            .map_err(|e| format!("cannot install vCPU kick handler: {e}"))
    })
    .clone()
    .map_err(Error::Config)
}

/// How a vCPU thread ended.
#[derive(Debug)]
pub enum VcpuOutcome {
    /// The guest asked to stop (or crashed) on this vCPU.
    Guest(GuestExit),
    /// The VMM asked this vCPU to stop.
    Stopped,
}

pub struct VcpuRunner {
    pub index: usize,
    pub fd: VcpuFd,
    pub pio: Arc<PioBus>,
    pub mmio: Arc<MmioBus>,
    pub stop: Arc<AtomicBool>,
}

impl VcpuRunner {
    pub fn run(mut self) -> Result<VcpuOutcome> {
        let run_ptr: *mut kvm_run = self.fd.get_kvm_run();
        KVM_RUN_PTR.with(|p| p.set(run_ptr));
        let result = self.run_loop();
        KVM_RUN_PTR.with(|p| p.set(null_mut()));
        result
    }

    fn fail(&self, reason: String) -> Error {
        Error::Vcpu {
            index: self.index,
            reason,
        }
    }

    /// Registers at a guest crash: the first thing anyone debugging it asks for.
    fn log_crash_state(&self) {
        let regs = self.fd.get_regs();
        let sregs = self.fd.get_sregs();
        let events = self.fd.get_vcpu_events();
        tracing::warn!(
            vcpu = self.index,
            ?regs,
            ?sregs,
            ?events,
            "guest triple fault"
        );
    }

    fn run_loop(&mut self) -> Result<VcpuOutcome> {
        loop {
            if self.stop.load(Ordering::Acquire) {
                return Ok(VcpuOutcome::Stopped);
            }
            match self.fd.run() {
                Ok(VcpuExit::IoIn(port, data)) => self.pio.read(port, data),
                Ok(VcpuExit::IoOut(port, data)) => {
                    if let Some(exit) = self.pio.write(port, data) {
                        return Ok(VcpuOutcome::Guest(exit));
                    }
                }
                Ok(VcpuExit::MmioRead(addr, data)) => self.mmio.read(addr, data),
                Ok(VcpuExit::MmioWrite(addr, data)) => self.mmio.write(addr, data),
                Ok(VcpuExit::Hlt) => {}
                Ok(VcpuExit::Shutdown) => {
                    self.log_crash_state();
                    return Ok(VcpuOutcome::Guest(GuestExit::TripleFault));
                }
                Ok(VcpuExit::SystemEvent(kind, _)) => {
                    let exit = match kind {
                        KVM_SYSTEM_EVENT_SHUTDOWN => GuestExit::PowerOff,
                        KVM_SYSTEM_EVENT_RESET => GuestExit::Reboot,
                        KVM_SYSTEM_EVENT_CRASH => GuestExit::TripleFault,
                        other => return Err(self.fail(format!("unknown system event {other}"))),
                    };
                    return Ok(VcpuOutcome::Guest(exit));
                }
                Ok(VcpuExit::FailEntry(reason, cpu)) => {
                    return Err(self.fail(format!(
                        "KVM_RUN entry failed: hardware reason {reason:#x} on host CPU {cpu}"
                    )))
                }
                Ok(VcpuExit::InternalError) => {
                    let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
                    return Err(self.fail(format!(
                        "KVM internal error (emulation failure?) at rip {rip:#x}"
                    )));
                }
                Ok(other) => {
                    let what = format!("{other:?}");
                    return Err(self.fail(format!("unexpected exit {what}")));
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    self.fd.set_kvm_immediate_exit(0);
                }
                Err(e) => return Err(self.fail(format!("KVM_RUN: {e}"))),
            }
        }
    }
}
