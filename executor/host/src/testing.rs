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
    idle_guest(dir, mem_mib, |_| Ok(()))
}

/// [`write_idle_guest_snapshot`] with a network interface (a virtio-net device the guest never
/// drives): its children get a network namespace and their VMMs attach to its tap.
pub fn write_idle_guest_snapshot_with_network(dir: &Path, mem_mib: u64) -> anyhow::Result<()> {
    idle_guest(dir, mem_mib, |vm| {
        vm.add_net(crate::network::GUEST_MAC, None)?;
        Ok(())
    })
}

/// [`write_idle_guest_snapshot`] with a vsock device the guest never drives, as an agent's
/// guest has: its children's VMMs run the vsock thread and listener. The parent's socket is
/// made beside `dir`.
pub fn write_idle_guest_snapshot_with_vsock(dir: &Path, mem_mib: u64) -> anyhow::Result<()> {
    idle_guest(dir, mem_mib, |vm| {
        vm.add_vsock(3, &dir.with_extension("vsock"))?;
        Ok(())
    })
}

fn idle_guest(
    dir: &Path,
    mem_mib: u64,
    devices: impl FnOnce(&mut Vm) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    // mov dx, 0x3f8; mov al, '1'; out dx, al; hlt; jmp -3 (back to hlt)
    let code = [0x66, 0xba, 0xf8, 0x03, 0xb0, b'1', 0xee, 0xf4, 0xeb, 0xfd];
    let ram = GuestRam::new_memfd(mem_mib)?;
    ram.memory().write_slice(&code, GuestAddress(CODE))?;
    let out = Capture::default();
    let mut vm = Vm::create(1, ram, Box::new(out.clone()))?;
    devices(&mut vm)?;
    run_and_snapshot(vm, out, dir, "the idle guest", |c| c.contains('1'))
}

/// Run a guest whose code is at [`CODE`] until its console satisfies `done` (30 s at most),
/// then snapshot it into `dir`.
fn snapshot_once(
    ram: GuestRam,
    dir: &Path,
    what: &str,
    done: impl Fn(&str) -> bool,
) -> anyhow::Result<()> {
    let out = Capture::default();
    let vm = Vm::create(1, ram, Box::new(out.clone()))?;
    run_and_snapshot(vm, out, dir, what, done)
}

fn run_and_snapshot(
    mut vm: Vm,
    out: Capture,
    dir: &Path,
    what: &str,
    done: impl Fn(&str) -> bool,
) -> anyhow::Result<()> {
    vm.set_entry(EntryPoint::Linux64 { rip: CODE })?;
    let running = vm.start()?;
    let t0 = Instant::now();
    while !done(&out.text()) {
        if t0.elapsed() > Duration::from_secs(30) {
            running.stop();
            let text = out.text();
            anyhow::bail!(
                "{what} never got there; its console: {:?}",
                text.get(..200).unwrap_or(&text)
            );
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
    let want = format!("{sum:016X}\n");
    snapshot_once(ram, dir, "the checksum guest", |c| c.contains(&want))?;
    Ok(sum)
}

/// Where the counter guest keeps its count.
pub const COUNTER: u64 = 0x20_0000;

/// Write into `dir` the snapshot of a guest that, forever, increments the u64 at [`COUNTER`],
/// prints it on COM1 as 16 hex digits and a newline, and spins a while. A child's console
/// shows where its memory came from: a branch's children carry on from the branch's count.
/// No agent: spawn with `Readiness::Running`.
pub fn write_counter_guest_snapshot(dir: &Path, mem_mib: u64) -> anyhow::Result<()> {
    counter_guest(dir, mem_mib, None)
}

/// [`write_counter_guest_snapshot`]'s guest, except that it asks for a reset (the i8042's)
/// once its time stamp counter has run `cycles` past its start: the parent is snapshotted
/// after its third line, and a child, whose counter carries on from the snapshot's, stops on
/// its own in what remains of `cycles` (about as long whatever the host's speed), and its VMM
/// ends with the guest.
pub fn write_stopping_counter_guest_snapshot(
    dir: &Path,
    mem_mib: u64,
    cycles: u64,
) -> anyhow::Result<()> {
    counter_guest(dir, mem_mib, Some(cycles))
}

fn counter_guest(dir: &Path, mem_mib: u64, stop_after: Option<u64>) -> anyhow::Result<()> {
    let mut code: Vec<u8> = Vec::new();
    if let Some(cycles) = stop_after {
        // rdtsc; shl rdx, 32; or rax, rdx; mov r8, cycles; add r8, rax (r8: the deadline)
        code.extend_from_slice(&[0x0f, 0x31, 0x48, 0xc1, 0xe2, 0x20, 0x48, 0x09, 0xd0]);
        code.extend_from_slice(&[0x49, 0xb8]);
        code.extend_from_slice(&cycles.to_le_bytes());
        code.extend_from_slice(&[0x49, 0x01, 0xc0]);
    }
    let top = code.len();
    // top: mov rbx, [COUNTER]; inc rbx; mov [COUNTER], rbx
    code.extend_from_slice(&[0x48, 0x8b, 0x1c, 0x25]);
    code.extend_from_slice(&(COUNTER as u32).to_le_bytes());
    code.extend_from_slice(&[0x48, 0xff, 0xc3]);
    code.extend_from_slice(&[0x48, 0x89, 0x1c, 0x25]);
    code.extend_from_slice(&(COUNTER as u32).to_le_bytes());
    // mov dx, 0x3f8; mov ecx, 16; hex digits of rbx as in the checksum guest
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03, 0xb9, 16, 0, 0, 0]);
    code.extend_from_slice(&[
        0x48, 0xc1, 0xc3, 0x04, 0x88, 0xd8, 0x24, 0x0f, 0x04, 0x30, 0x3c, 0x39, 0x76, 0x02, 0x04,
        0x07, 0xee, 0xff, 0xc9, 0x75, 0xeb,
    ]);
    // mov al, '\n'; out dx, al; mov ecx, 1 << 16; spin: dec ecx; jnz spin
    code.extend_from_slice(&[0xb0, 0x0a, 0xee, 0xb9]);
    code.extend_from_slice(&(1u32 << 16).to_le_bytes());
    code.extend_from_slice(&[0xff, 0xc9, 0x75, 0xfc]);
    if stop_after.is_some() {
        // rdtsc; shl rdx, 32; or rax, rdx; cmp rax, r8; jb top
        code.extend_from_slice(&[0x0f, 0x31, 0x48, 0xc1, 0xe2, 0x20, 0x48, 0x09, 0xd0]);
        code.extend_from_slice(&[0x4c, 0x39, 0xc0, 0x0f, 0x82]);
        let back = top as i32 - (code.len() + 4) as i32;
        code.extend_from_slice(&back.to_le_bytes());
        // mov al, 0xfe; out 0x64, al (the i8042's reset); hlt; jmp back to hlt
        code.extend_from_slice(&[0xb0, 0xfe, 0xe6, 0x64, 0xf4, 0xeb, 0xfd]);
    } else {
        // jmp top
        code.push(0xe9);
        let back = top as i32 - (code.len() + 4) as i32;
        code.extend_from_slice(&back.to_le_bytes());
    }

    let ram = GuestRam::new_memfd(mem_mib)?;
    ram.memory().write_slice(&code, GuestAddress(CODE))?;
    snapshot_once(ram, dir, "the counter guest", |c| c.lines().count() >= 3)
}

/// Where the hog guest's writes start.
pub const HOG_START: u64 = 0x80_0000;

/// Write into `dir` the snapshot of a guest that, forever, increments a word in every page
/// of its RAM from [`HOG_START`] to its end and prints `.` on COM1 after each pass. A child
/// makes every one of those pages its own within a pass: `mem_mib` MiB, less 8, of host
/// memory, as a guest that allocates without bound would. No agent: spawn with
/// `Readiness::Running`.
pub fn write_hog_guest_snapshot(dir: &Path, mem_mib: u64) -> anyhow::Result<()> {
    let pages = ((mem_mib << 20) - HOG_START) / 4096;
    let mut code: Vec<u8> = Vec::new();
    // top: mov rsi, HOG_START; mov rcx, pages
    code.extend_from_slice(&[0x48, 0xbe]);
    code.extend_from_slice(&HOG_START.to_le_bytes());
    code.extend_from_slice(&[0x48, 0xb9]);
    code.extend_from_slice(&pages.to_le_bytes());
    // page: inc qword [rsi]; add rsi, 4096; dec rcx; jnz page
    code.extend_from_slice(&[
        0x48, 0xff, 0x06, 0x48, 0x81, 0xc6, 0x00, 0x10, 0x00, 0x00, 0x48, 0xff, 0xc9, 0x75, 0xf1,
    ]);
    // mov dx, 0x3f8; mov al, '.'; out dx, al; jmp top
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03, 0xb0, b'.', 0xee, 0xe9]);
    let back = -((code.len() + 4) as i32);
    code.extend_from_slice(&back.to_le_bytes());
    let ram = GuestRam::new_memfd(mem_mib)?;
    ram.memory().write_slice(&code, GuestAddress(CODE))?;
    snapshot_once(ram, dir, "the hog guest", |c| c.contains('.'))
}

/// The counts a counter guest's console shows (whole lines only).
pub fn counts(console: &str) -> Vec<u64> {
    console
        .lines()
        .filter(|l| l.len() == 16)
        .filter_map(|l| u64::from_str_radix(l, 16).ok())
        .collect()
}

/// For a test binary that doubles as the VMM worker (`<test> __vmm-worker`, as `tine` is in
/// production): runs the worker and exits when started as one, returns otherwise.
pub fn serve_as_worker_if_asked() {
    if std::env::args().nth(1).as_deref() == Some(crate::worker::WORKER_SUBCOMMAND) {
        let code = match crate::worker::worker_main() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("worker: {e:#}");
                1
            }
        };
        std::process::exit(code);
    }
}

/// The host configuration the host-crate tests use on `data`: owned by executor "test",
/// children ready when their VMM runs (the hand-made guests have no agent), no store and no
/// child networks (tests add what they exercise).
pub fn test_host_config(data: &Path, max_vms: u32, pool_size: usize) -> crate::HostConfig {
    crate::HostConfig {
        data_dir: data.to_path_buf(),
        image_cache: data.join("images"),
        worker_exe: std::env::current_exe().expect("the test binary's path"),
        owner: crate::Owner::Executor("test".into()),
        readiness: crate::Readiness::Running,
        limits: crate::Limits {
            max_vms,
            pool_size,
            // A fixed pool: tests that grow it say so.
            pool_max: pool_size,
            ready_timeout: Duration::from_secs(60),
            ..crate::Limits::default()
        },
        store: None,
        network: None,
        cgroups: crate::CgroupMode::Off,
        // Confined as in production: every host test runs its VMMs under their own users,
        // in their own views, behind the allow-list.
        confine: crate::Confinement::default(),
    }
}
