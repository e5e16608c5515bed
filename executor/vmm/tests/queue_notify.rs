//! virtio queue notifications with hand-made guests on /dev/kvm: the guest sets a virtio-mmio
//! device up through its registers (features, queues, DRIVER_OK) and writes queue indices to
//! QueueNotify. With ioeventfds (the default) KVM signals the device's eventfds and the write
//! never reaches the VMM's MMIO exit path; without them (or where KVM refuses them) every
//! write is an exit handled on the vCPU thread. Both must reach the device, the vsock device
//! must move a guest packet either way, and a restored child must get eventfds of its own.

mod common;

use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{kvm_available, out8, wait_for, Capture, POWER_OFF};
use kvm_ioctls::{Cap, IoEventAddress};
use tine_vmm::boot::EntryPoint;
use tine_vmm::devices::virtio::vsock::Header;
use tine_vmm::devices::virtio::{IrqLine, VirtioDevice};
use tine_vmm::layout::VIRTIO_MMIO_BASE;
use tine_vmm::snapshot::devices::VirtioKind;
use tine_vmm::vm::RestoreOptions;
use tine_vmm::{GuestExit, GuestRam, NotifyPath, Vm, VmOptions};
use virtio_queue::{Queue, QueueState};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::EventFd;

const CODE: u64 = 0x10_0000;
const FLAG: u64 = 0x3008;
/// Queue `q`'s descriptor table; its available ring is 4 KiB above, its used ring 8 KiB above.
const RINGS: u64 = 0x20_0000;
const QUEUE_SIZE: u32 = 16;
/// The one guest packet's buffer.
const PACKET: u64 = 0x30_0000;

/// Register offsets in a virtio-mmio window (virtio 1.2, 4.2.2).
const DRIVER_FEATURES: u32 = 0x20;
const DRIVER_FEATURES_SEL: u32 = 0x24;
const QUEUE_SEL: u32 = 0x30;
const QUEUE_NUM: u32 = 0x38;
const QUEUE_READY: u32 = 0x44;
const QUEUE_NOTIFY: u32 = 0x50;
const STATUS: u32 = 0x70;
const QUEUE_DESC_LOW: u32 = 0x80;
const QUEUE_DRIVER_LOW: u32 = 0x90;
const QUEUE_DEVICE_LOW: u32 = 0xa0;

fn ring(q: u32) -> u64 {
    RINGS + q as u64 * 0x1_0000
}

/// `mov eax, addr; mov dword [rax], value`: a 4-byte MMIO write (same bytes in 32-bit mode).
fn write32(code: &mut Vec<u8>, addr: u32, value: u32) {
    code.push(0xb8);
    code.extend_from_slice(&addr.to_le_bytes());
    code.extend_from_slice(&[0xc7, 0x00]);
    code.extend_from_slice(&value.to_le_bytes());
}

/// What a virtio driver does up to DRIVER_OK, for the first device's `queues` queues.
fn driver_setup(code: &mut Vec<u8>, queues: u32) {
    let reg = |r: u32| VIRTIO_MMIO_BASE as u32 + r;
    write32(code, reg(STATUS), 1); // ACKNOWLEDGE
    write32(code, reg(STATUS), 1 | 2); // DRIVER
    write32(code, reg(DRIVER_FEATURES_SEL), 1);
    write32(code, reg(DRIVER_FEATURES), 1); // VIRTIO_F_VERSION_1 (bit 32)
    write32(code, reg(STATUS), 1 | 2 | 8); // FEATURES_OK
    for q in 0..queues {
        write32(code, reg(QUEUE_SEL), q);
        write32(code, reg(QUEUE_NUM), QUEUE_SIZE);
        write32(code, reg(QUEUE_DESC_LOW), ring(q) as u32);
        write32(code, reg(QUEUE_DRIVER_LOW), ring(q) as u32 + 0x1000);
        write32(code, reg(QUEUE_DEVICE_LOW), ring(q) as u32 + 0x2000);
        write32(code, reg(QUEUE_READY), 1);
    }
    write32(code, reg(STATUS), 1 | 2 | 8 | 4); // DRIVER_OK
}

fn notify(code: &mut Vec<u8>, queue: u32) {
    write32(code, VIRTIO_MMIO_BASE as u32 + QUEUE_NOTIFY, queue);
}

/// `mov rax, [FLAG]; test rax, rax; jz back`: spin until the host sets FLAG.
fn spin_until_flag(code: &mut Vec<u8>) {
    code.extend_from_slice(&[0x48, 0x8b, 0x04, 0x25]);
    code.extend_from_slice(&(FLAG as u32).to_le_bytes());
    code.extend_from_slice(&[0x48, 0x85, 0xc0, 0x74, 0xf3]);
}

fn new_vm(code: &[u8], options: VmOptions) -> (Vm, Capture) {
    let ram = GuestRam::new_memfd(64).unwrap();
    ram.memory().write_slice(code, GuestAddress(CODE)).unwrap();
    let out = Capture::default();
    let vm = Vm::create_with(1, ram, Box::new(out.clone()), options).unwrap();
    (vm, out)
}

/// Whether this host's KVM offers ioeventfds at all.
fn kvm_has_ioeventfd() -> bool {
    tine_vmm::host::open_kvm()
        .unwrap()
        .check_extension(Cap::Ioeventfd)
}

const ON: VmOptions = VmOptions { ioeventfd: true };
const OFF: VmOptions = VmOptions { ioeventfd: false };

/// A device that only counts: notifications that came as `queue_notify` calls (MMIO exits),
/// and keeps the eventfds it was given so the test can read how often KVM signalled each.
struct Counter {
    queues: Vec<u16>,
    take_events: bool,
    exits: Arc<Vec<AtomicU32>>,
    events: Arc<Mutex<Vec<Arc<EventFd>>>>,
}

#[derive(Clone)]
struct Counts {
    exits: Arc<Vec<AtomicU32>>,
    events: Arc<Mutex<Vec<Arc<EventFd>>>>,
}

impl Counts {
    fn exits(&self) -> Vec<u32> {
        self.exits
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .collect()
    }

    /// How many times KVM signalled each queue's eventfd (empty if none were attached).
    fn signalled(&self) -> Vec<u32> {
        self.events
            .lock()
            .unwrap()
            .iter()
            .map(|e| e.read().map_or(0, |n| n as u32))
            .collect()
    }
}

fn counter(queues: usize, take_events: bool) -> (Box<dyn VirtioDevice>, Counts) {
    let counts = Counts {
        exits: Arc::new((0..queues).map(|_| AtomicU32::new(0)).collect()),
        events: Arc::default(),
    };
    let dev = Counter {
        queues: vec![QUEUE_SIZE as u16; queues],
        take_events,
        exits: counts.exits.clone(),
        events: counts.events.clone(),
    };
    (Box::new(dev), counts)
}

impl VirtioDevice for Counter {
    fn device_type(&self) -> u32 {
        // virtio "entropy source": any id will do, the guest is ours.
        4
    }
    fn features(&self) -> u64 {
        0
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &self.queues
    }
    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }
    fn activate(&mut self, _: GuestMemoryMmap, _: Vec<Queue>, _: IrqLine, _: u64) {}
    fn queue_notify(&mut self, queue: u16) {
        self.exits[queue as usize].fetch_add(1, Ordering::SeqCst);
    }
    fn attach_queue_events(&mut self, events: &[Arc<EventFd>]) -> bool {
        if self.take_events {
            *self.events.lock().unwrap() = events.to_vec();
        }
        self.take_events
    }
    fn reset(&mut self) {}
    fn set_paused(&mut self, _: bool) {}
    fn queue_states(&self) -> Vec<QueueState> {
        Vec::new()
    }
    fn kind(&self) -> VirtioKind {
        VirtioKind::Vsock { guest_cid: 3 }
    }
    fn after_restore(&mut self) {}
}

/// Activate the device, notify queue 1 twice and queue 0 once, write an index the device does
/// not have (an exit either way, ignored by the transport), then power off.
fn notifying_guest(queues: u32) -> Vec<u8> {
    let mut code = Vec::new();
    driver_setup(&mut code, queues);
    notify(&mut code, 1);
    notify(&mut code, 1);
    notify(&mut code, 0);
    notify(&mut code, 7);
    out8(&mut code, POWER_OFF.0, POWER_OFF.1);
    code
}

fn run_counter(options: VmOptions, queues: usize, take_events: bool) -> (NotifyPath, Counts) {
    let (mut vm, _) = new_vm(&notifying_guest(queues as u32), options);
    let (dev, counts) = counter(queues, take_events);
    vm.add_virtio(dev).unwrap();
    vm.set_entry(EntryPoint::Linux64 { rip: CODE }).unwrap();
    let path = vm.notify_paths()[0];
    assert_eq!(vm.run().unwrap(), GuestExit::PowerOff);
    (path, counts)
}

#[test]
fn guest_notifications_reach_the_device_through_ioeventfds() {
    if !kvm_available() {
        return;
    }
    let (path, counts) = run_counter(ON, 2, true);
    if path == NotifyPath::VcpuExit {
        // Only acceptable where KVM has no ioeventfds at all; then the fallback must work.
        assert!(
            !kvm_has_ioeventfd(),
            "KVM offers ioeventfds but the device was not wired to them"
        );
        eprintln!("NOTE: KVM has no ioeventfds here; checked the MMIO-exit fallback instead");
        assert_eq!(counts.exits(), [1, 2]);
        return;
    }
    // Every notification came through KVM, by queue index; none exited to the VMM.
    assert_eq!(counts.signalled(), [1, 2]);
    assert_eq!(counts.exits(), [0, 0]);
}

#[test]
fn without_ioeventfds_notifications_exit_to_the_vcpu_thread() {
    if !kvm_available() {
        return;
    }
    let (path, counts) = run_counter(OFF, 2, true);
    assert_eq!(path, NotifyPath::VcpuExit);
    assert!(
        counts.signalled().is_empty(),
        "no eventfds without the option"
    );
    assert_eq!(counts.exits(), [1, 2]);
}

#[test]
fn a_device_that_declines_queue_events_keeps_the_exit_path() {
    if !kvm_available() {
        return;
    }
    // Its eventfds were registered, then unregistered: nothing may swallow the writes.
    let (path, counts) = run_counter(ON, 2, false);
    assert_eq!(path, NotifyPath::VcpuExit);
    assert_eq!(counts.exits(), [1, 2]);
}

#[test]
fn a_refused_registration_falls_back_to_exits_for_every_queue() {
    if !kvm_available() || !kvm_has_ioeventfd() {
        return;
    }
    // Someone already holds queue 2's match at this address: KVM refuses ours (EEXIST), and
    // queues 0 and 1, registered just before, must be given back.
    let (mut vm, _) = new_vm(&notifying_guest(3), ON);
    let squatter = EventFd::new(0).unwrap();
    vm.vm_fd()
        .register_ioevent(
            &squatter,
            &IoEventAddress::Mmio(VIRTIO_MMIO_BASE + QUEUE_NOTIFY as u64),
            2u32,
        )
        .unwrap();
    let (dev, counts) = counter(3, true);
    vm.add_virtio(dev).unwrap();
    vm.set_entry(EntryPoint::Linux64 { rip: CODE }).unwrap();
    assert_eq!(vm.notify_paths(), [NotifyPath::VcpuExit]);
    assert_eq!(vm.run().unwrap(), GuestExit::PowerOff);
    assert!(counts.signalled().is_empty());
    assert_eq!(counts.exits(), [1, 2, 0]);
}

// vsock: a guest packet asking to connect to host port PORT must reach `<socket>_PORT`.

const PORT: u32 = 5005;
const GUEST_CID: u64 = 3;

/// Put one OP_REQUEST (guest port 1234 → host port PORT) on the transmit queue (queue 1).
fn post_connect_request(mem: &GuestMemoryMmap) {
    let h = Header {
        src_cid: GUEST_CID,
        dst_cid: 2,
        src_port: 1234,
        dst_port: PORT,
        type_: 1, // stream
        op: 1,    // request
        buf_alloc: 64 * 1024,
        ..Default::default()
    };
    let bytes = h.to_bytes();
    mem.write_slice(&bytes, GuestAddress(PACKET)).unwrap();
    let tx = ring(1);
    // Descriptor 0: the header, device-readable.
    mem.write_obj(PACKET, GuestAddress(tx)).unwrap();
    mem.write_obj(bytes.len() as u32, GuestAddress(tx + 8))
        .unwrap();
    mem.write_obj(0u16, GuestAddress(tx + 12)).unwrap();
    // Available ring: ring[0] = 0, then idx = 1.
    mem.write_obj(0u16, GuestAddress(tx + 0x1000 + 4)).unwrap();
    mem.write_obj(1u16, GuestAddress(tx + 0x1000 + 2)).unwrap();
}

/// Wait for the device to connect to `<uds>_PORT`.
fn expect_connection(listener: &UnixListener, what: &str) {
    listener.set_nonblocking(true).unwrap();
    let t0 = Instant::now();
    loop {
        match listener.accept() {
            Ok(_) => return,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "{what}: the guest's connection request never reached the host"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("{what}: accept: {e}"),
        }
    }
}

fn host_port_listener(uds: &Path) -> UnixListener {
    UnixListener::bind(format!("{}_{PORT}", uds.display())).unwrap()
}

fn vsock_guest_sends_a_packet(options: VmOptions) {
    let tmp = tempfile::tempdir().unwrap();
    let uds = tmp.path().join("v.sock");
    let listener = host_port_listener(&uds);
    let mut code = Vec::new();
    driver_setup(&mut code, 3);
    notify(&mut code, 1);
    code.extend_from_slice(&[0xeb, 0xfe]); // jmp .
    let (mut vm, _) = new_vm(&code, options);
    post_connect_request(vm.ram().memory());
    vm.add_vsock(GUEST_CID, &uds).unwrap();
    let path = vm.notify_paths()[0];
    if options.ioeventfd && kvm_has_ioeventfd() {
        assert_eq!(path, NotifyPath::Ioeventfd);
    } else if options.ioeventfd {
        eprintln!("NOTE: KVM has no ioeventfds here; the vsock test ran on MMIO exits");
    } else {
        assert_eq!(path, NotifyPath::VcpuExit);
    }
    vm.set_entry(EntryPoint::Linux64 { rip: CODE }).unwrap();
    let running = vm.start().unwrap();
    expect_connection(&listener, &format!("{path:?}"));
    running.stop();
}

#[test]
fn vsock_transmit_works_with_ioeventfds() {
    if !kvm_available() {
        return;
    }
    vsock_guest_sends_a_packet(ON);
}

#[test]
fn vsock_transmit_works_without_ioeventfds() {
    if !kvm_available() {
        return;
    }
    vsock_guest_sends_a_packet(OFF);
}

#[test]
fn restored_children_get_eventfds_of_their_own() {
    if !kvm_available() {
        return;
    }
    // The parent activates its vsock, says "1", spins on FLAG, then notifies its transmit
    // queue. It is snapshotted mid-spin, so only the children ever notify.
    let tmp = tempfile::tempdir().unwrap();
    let mut code = Vec::new();
    driver_setup(&mut code, 3);
    out8(&mut code, 0x3f8, b'1');
    spin_until_flag(&mut code);
    notify(&mut code, 1);
    code.extend_from_slice(&[0xeb, 0xfe]); // jmp .
    let (mut vm, out) = new_vm(&code, ON);
    vm.add_vsock(GUEST_CID, &tmp.path().join("parent.sock"))
        .unwrap();
    vm.set_entry(EntryPoint::Linux64 { rip: CODE }).unwrap();
    let running = vm.start().unwrap();
    wait_for(&out, "1");
    let snap = tmp.path().join("snap");
    running.snapshot(&snap).unwrap();
    running.stop();

    // Two children with ioeventfds, one without, all running at once, each on its own socket:
    // each one's notification must reach its own device.
    let mut children = Vec::new();
    for (i, options) in [ON, ON, OFF].into_iter().enumerate() {
        let uds = tmp.path().join(format!("child{i}.sock"));
        let listener = host_port_listener(&uds);
        let vm = Vm::restore_with(
            &snap,
            RestoreOptions {
                console: Box::new(std::io::sink()),
                vsock_uds: Some(uds),
                tap: None,
            },
            options,
        )
        .unwrap();
        let want = if options.ioeventfd && kvm_has_ioeventfd() {
            NotifyPath::Ioeventfd
        } else {
            NotifyPath::VcpuExit
        };
        assert_eq!(vm.notify_paths(), [want], "child {i}");
        post_connect_request(vm.ram().memory());
        children.push((vm, listener));
    }
    let mut running = Vec::new();
    for (vm, listener) in children {
        vm.ram()
            .memory()
            .write_obj(1u64, GuestAddress(FLAG))
            .unwrap();
        running.push((vm.start().unwrap(), listener));
    }
    for (i, (child, listener)) in running.into_iter().enumerate() {
        expect_connection(&listener, &format!("child {i}"));
        child.stop();
    }
}

/// What one notification costs the guest, each way: `cargo test -p tine-vmm --test
/// queue_notify -- --ignored --nocapture`. Informative only (no assertion on the numbers).
#[test]
#[ignore]
fn notification_cost() {
    if !kvm_available() {
        return;
    }
    const N: u32 = 200_000;
    let mut code = Vec::new();
    driver_setup(&mut code, 2);
    // mov eax, QueueNotify; mov ecx, N; 1: mov dword [rax], 1; dec ecx; jnz 1b
    code.push(0xb8);
    code.extend_from_slice(&(VIRTIO_MMIO_BASE as u32 + QUEUE_NOTIFY).to_le_bytes());
    code.push(0xb9);
    code.extend_from_slice(&N.to_le_bytes());
    code.extend_from_slice(&[0xc7, 0x00, 1, 0, 0, 0, 0xff, 0xc9, 0x75, 0xf6]);
    out8(&mut code, POWER_OFF.0, POWER_OFF.1);
    for options in [ON, OFF] {
        let (mut vm, _) = new_vm(&code, options);
        let (dev, counts) = counter(2, true);
        vm.add_virtio(dev).unwrap();
        vm.set_entry(EntryPoint::Linux64 { rip: CODE }).unwrap();
        let path = vm.notify_paths()[0];
        let t0 = Instant::now();
        assert_eq!(vm.run().unwrap(), GuestExit::PowerOff);
        let took = t0.elapsed();
        let seen = counts.exits()[1] + counts.signalled().get(1).copied().unwrap_or(0);
        assert_eq!(seen, N);
        eprintln!(
            "{path:?}: {N} notifications in {took:?}, {:.2} us each",
            took.as_secs_f64() * 1e6 / N as f64
        );
    }
}
