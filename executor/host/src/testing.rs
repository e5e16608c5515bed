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

/// Where the checksum guest's data lives and how much of it there is.
pub const CHECKSUM_DATA: u64 = 0x40_0000;

/// Write into `dir` the snapshot of a guest that, forever, XORs together the 64-bit words of
/// `data_mib` MiB of pseudo-random data (from `seed`) at [`CHECKSUM_DATA`] and prints the
/// result on COM1 as 16 hex digits and a newline. A restored child keeps printing it, so its
/// console shows whether every page it read arrived intact (lazy restore). Returns the
/// checksum it prints. No agent: spawn with `Readiness::Running`.
pub fn write_checksum_guest_snapshot(
    dir: &Path,
    mem_mib: u64,
    data_mib: u64,
    seed: u64,
) -> anyhow::Result<u64> {
    let words = (data_mib << 20) / 8;
    let mut code: Vec<u8> = Vec::new();
    // start: mov rsi, DATA; mov rcx, words; xor rax, rax
    code.extend_from_slice(&[0x48, 0xbe]);
    code.extend_from_slice(&CHECKSUM_DATA.to_le_bytes());
    code.extend_from_slice(&[0x48, 0xb9]);
    code.extend_from_slice(&words.to_le_bytes());
    code.extend_from_slice(&[0x48, 0x31, 0xc0]);
    // sum: xor rax, [rsi]; add rsi, 8; dec rcx; jnz sum
    code.extend_from_slice(&[
        0x48, 0x33, 0x06, 0x48, 0x83, 0xc6, 0x08, 0x48, 0xff, 0xc9, 0x75, 0xf4,
    ]);
    // mov rbx, rax; mov dx, 0x3f8; mov ecx, 16
    code.extend_from_slice(&[0x48, 0x89, 0xc3, 0x66, 0xba, 0xf8, 0x03, 0xb9, 16, 0, 0, 0]);
    // hex: rol rbx, 4; mov al, bl; and al, 15; add al, '0'; cmp al, '9'; jbe +2; add al, 7;
    //      out dx, al; dec ecx; jnz hex
    code.extend_from_slice(&[
        0x48, 0xc1, 0xc3, 0x04, 0x88, 0xd8, 0x24, 0x0f, 0x04, 0x30, 0x3c, 0x39, 0x76, 0x02, 0x04,
        0x07, 0xee, 0xff, 0xc9, 0x75, 0xeb,
    ]);
    // mov al, '\n'; out dx, al; jmp start
    code.extend_from_slice(&[0xb0, 0x0a, 0xee, 0xe9]);
    let back = -((code.len() + 4) as i32);
    code.extend_from_slice(&back.to_le_bytes());

    let ram = GuestRam::new_memfd(mem_mib)?;
    ram.memory().write_slice(&code, GuestAddress(CODE))?;
    let mut x = seed | 1;
    let mut sum = 0u64;
    let mut data = Vec::with_capacity((data_mib << 20) as usize);
    for _ in 0..words {
        // xorshift64: incompressible enough that every chunk holds real bytes.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        sum ^= x;
        data.extend_from_slice(&x.to_le_bytes());
    }
    ram.memory()
        .write_slice(&data, GuestAddress(CHECKSUM_DATA))?;
    let out = Capture::default();
    let mut vm = Vm::create(1, ram, Box::new(out.clone()))?;
    vm.set_entry(EntryPoint::Linux64 { rip: CODE })?;
    let running = vm.start()?;
    let want = format!("{sum:016X}\n");
    let t0 = Instant::now();
    while !out.text().contains(&want) {
        if t0.elapsed() > Duration::from_secs(30) {
            running.stop();
            anyhow::bail!(
                "the checksum guest never printed {want:?}: {:?}",
                out.text().get(..200)
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let r = running.snapshot(dir);
    running.stop();
    r?;
    Ok(sum)
}
