//! The virtio-mmio transport and the vsock device as a hostile guest drives them: guest memory
//! (descriptor tables, rings, packet headers and payloads) is the fuzz input, and so are the
//! queue layout and a sequence of register writes, notifications and memory changes. The
//! harness first sets the device up the way a driver does, so the queues are live from the
//! start. Nothing may panic, loop forever, or touch memory outside the guest's.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use tine_vmm::devices::mmio::MmioDevice;
use tine_vmm::devices::virtio::mmio::VirtioMmio;
use tine_vmm::devices::virtio::vsock::Vsock;
use tine_vmm::devices::virtio::IrqLine;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

/// Guest RAM: small, so random addresses often land in it.
const MEM: u64 = 64 << 10;

#[derive(Arbitrary, Debug)]
struct QueueSetup {
    /// log2 of the queue size (taken modulo 9: 1..=256).
    size_log2: u8,
    desc: u16,
    avail: u16,
    used: u16,
}

#[derive(Arbitrary, Debug)]
enum Op {
    Notify(u8),
    Write { offset: u16, value: u32 },
    Read { offset: u16 },
    Poke { addr: u16, bytes: Vec<u8> },
}

#[derive(Arbitrary, Debug)]
struct Input {
    /// The driver's feature bits (VIRTIO_F_VERSION_1 is always acked).
    features_low: u32,
    queues: [QueueSetup; 3],
    memory: Vec<(u16, Vec<u8>)>,
    ops: Vec<Op>,
}

fn uds() -> &'static PathBuf {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("vsock.sock");
        (d, p)
    })
    .1
}

fn w(dev: &mut VirtioMmio, offset: u64, value: u32) {
    dev.write(offset, &value.to_le_bytes());
}

fuzz_target!(|input: Input| {
    let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM as usize)]).unwrap();
    for (addr, bytes) in input.memory.iter().take(64) {
        let room = (MEM - u64::from(*addr)) as usize;
        let _ = mem.write_slice(
            &bytes[..bytes.len().min(room)],
            GuestAddress(u64::from(*addr)),
        );
    }
    let Ok(vsock) = Vsock::new(3, uds()) else {
        return;
    };
    let irq = IrqLine::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let mut dev = VirtioMmio::new(Box::new(vsock), mem.clone(), irq);

    // A driver's set-up (virtio 1.2, 3.1.1): reset, ACKNOWLEDGE, DRIVER, features, FEATURES_OK,
    // the queues, DRIVER_OK.
    w(&mut dev, 0x070, 0);
    w(&mut dev, 0x070, 1);
    w(&mut dev, 0x070, 1 | 2);
    w(&mut dev, 0x024, 0);
    w(&mut dev, 0x020, input.features_low);
    w(&mut dev, 0x024, 1);
    w(&mut dev, 0x020, 1);
    w(&mut dev, 0x070, 1 | 2 | 8);
    for (i, q) in input.queues.iter().enumerate() {
        w(&mut dev, 0x030, i as u32);
        w(&mut dev, 0x038, 1 << (q.size_log2 % 9));
        w(&mut dev, 0x080, u32::from(q.desc) & !15);
        w(&mut dev, 0x084, 0);
        w(&mut dev, 0x090, u32::from(q.avail) & !1);
        w(&mut dev, 0x094, 0);
        w(&mut dev, 0x0a0, u32::from(q.used) & !3);
        w(&mut dev, 0x0a4, 0);
        w(&mut dev, 0x044, 1);
    }
    w(&mut dev, 0x070, 1 | 2 | 8 | 4);

    for op in input.ops.iter().take(256) {
        match op {
            Op::Notify(q) => w(&mut dev, 0x050, u32::from(*q % 4)),
            Op::Write { offset, value } => w(&mut dev, u64::from(*offset % 0x200), *value),
            Op::Read { offset } => {
                let mut data = [0u8; 4];
                dev.read(u64::from(*offset % 0x200), &mut data);
            }
            Op::Poke { addr, bytes } => {
                let room = (MEM - u64::from(*addr)) as usize;
                let _ = mem.write_slice(
                    &bytes[..bytes.len().min(room)],
                    GuestAddress(u64::from(*addr)),
                );
            }
        }
    }
});
