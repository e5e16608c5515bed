//! Hand-made guests for tests of the host and the services above it on a machine's own
//! /dev/kvm (where a Linux guest may not boot, e.g. PVM hosts). Built only with the `testing`
//! feature.

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tine_vmm::boot::EntryPoint;
use tine_vmm::{GuestRam, Vm};
use vm_memory::{Bytes, GuestAddress};

const CODE: u64 = 0x10_0000;

/// A console that keeps what the guest printed.
#[derive(Clone, Default)]
pub struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }
}

pub fn kvm_available() -> bool {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok()
}

/// Write into `dir` the snapshot of a guest that printed `1` on COM1 and then halts forever
/// (`hlt; jmp hlt`, no interrupts armed): restored children run and stay idle. The guest has
/// no agent, so spawn it with `Readiness::Running`.
pub fn write_idle_guest_snapshot(dir: &Path, mem_mib: u64) -> anyhow::Result<()> {
    // mov dx, 0x3f8; mov al, '1'; out dx, al; hlt; jmp -3 (back to hlt)
    let code = [0x66, 0xba, 0xf8, 0x03, 0xb0, b'1', 0xee, 0xf4, 0xeb, 0xfd];
    let ram = GuestRam::new_memfd(mem_mib)?;
    ram.memory().write_slice(&code, GuestAddress(CODE))?;
    let out = Capture::default();
    let mut vm = Vm::create(1, ram, Box::new(out.clone()))?;
    vm.set_entry(EntryPoint::Linux64 { rip: CODE })?;
    let running = vm.start()?;
    let t0 = Instant::now();
    while !out.text().contains('1') {
        if t0.elapsed() > Duration::from_secs(30) {
            running.stop();
            anyhow::bail!("the idle guest never printed its marker");
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let r = running.snapshot(dir);
    running.stop();
    r?;
    Ok(())
}
