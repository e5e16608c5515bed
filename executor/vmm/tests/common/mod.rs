//! Shared pieces of the hand-made-guest tests.
#![allow(dead_code)]

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A console that keeps everything the guest printed.
#[derive(Clone, Default)]
pub struct Capture(pub Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Capture {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// `mov dx, port; mov al, byte; out dx, al` — the same bytes in 32- and 64-bit mode.
pub fn out8(code: &mut Vec<u8>, port: u16, byte: u8) {
    code.extend_from_slice(&[0x66, 0xba]);
    code.extend_from_slice(&port.to_le_bytes());
    code.extend_from_slice(&[0xb0, byte, 0xee]);
}

/// ACPI S5 through our sleep-control register.
pub const POWER_OFF: (u16, u8) = (0x600, 0x20 | (5 << 2));

pub fn kvm_available() -> bool {
    if std::path::Path::new("/dev/kvm").exists() {
        return true;
    }
    eprintln!("SKIPPED: /dev/kvm is absent on this host; the tiny-guest tests need KVM");
    false
}

/// Wait (up to 30 s) until the guest has printed `text`.
pub fn wait_for(cap: &Capture, text: &str) {
    let t0 = Instant::now();
    while !cap.text().contains(text) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "guest never printed {text:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Boot a fresh 64 MiB, 1-vCPU VM running 64-bit `code` placed at `at`, and wait until it
/// printed "1" (every test guest prints it first).
pub fn boot_guest(code: &[u8], at: u64) -> (tine_vmm::vm::RunningVm, Capture) {
    use vm_memory::{Bytes, GuestAddress};
    let ram = tine_vmm::GuestRam::new_memfd(64).unwrap();
    ram.memory().write_slice(code, GuestAddress(at)).unwrap();
    let out = Capture::default();
    let mut vm = tine_vmm::Vm::create(1, ram, Box::new(out.clone())).unwrap();
    vm.set_entry(tine_vmm::boot::EntryPoint::Linux64 { rip: at })
        .unwrap();
    let running = vm.start().unwrap();
    wait_for(&out, "1");
    (running, out)
}
