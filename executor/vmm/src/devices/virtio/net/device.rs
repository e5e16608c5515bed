//! The virtio device: config space (the MAC), feature negotiation, and moving frames between
//! the RX/TX virtqueues and the tap.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueOwnedT, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::tap::{Tap, TUN_F_CSUM, VNET_HDR_LEN};
use super::{event_loop, Mac, DEVICE_ID};
use crate::devices::virtio::queue_events::QueueEvents;
use crate::devices::virtio::runner::Runner;
use crate::devices::virtio::used_irq::{IrqCounts, UsedIrq};
use crate::devices::virtio::{DeviceLoop, IrqLine, VirtioDevice};
use crate::error::DeviceError;
use crate::snapshot::devices::VirtioKind;

const QUEUE_SIZE: u16 = 256;
const RX: usize = 0;
const TX: usize = 1;
/// Receive and transmit.
pub const QUEUES: usize = 2;

/// Feature bits (virtio 1.2, 5.1.3).
const F_CSUM: u64 = 1 << 0;
const F_GUEST_CSUM: u64 = 1 << 1;
const F_MAC: u64 = 1 << 5;
const F_HOST_TSO4: u64 = 1 << 11;
const F_HOST_TSO6: u64 = 1 << 12;

/// The largest frame either way: a 64 KiB TSO frame, its Ethernet header and the vnet header.
pub(super) const MAX_FRAME: usize = 65562;

/// Epoll tokens: the tap, and queue `q`'s notification eventfd at `TOKEN_QUEUE_BASE + q`.
pub(super) const TOKEN_TAP: u64 = 1;
/// The device's own wake-up: more work left after a pass's budget, or the device dropped.
pub(super) const TOKEN_KICK: u64 = 2;

/// Descriptor chains one pass handles per queue before letting go of the lock: a guest that
/// keeps posting, or a flood of frames, cannot hold the device (and a snapshot's pause) forever.
const BUDGET: usize = QUEUE_SIZE as usize;
pub(super) const TOKEN_QUEUE_BASE: u64 = 1 << 63;

/// Counters a test or a log line can read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    pub tx_frames: u64,
    pub rx_frames: u64,
    /// Frames the guest sent with no tap to take them, or the tap refused.
    pub tx_dropped: u64,
    /// Frames from the tap that no guest buffer could hold.
    pub rx_dropped: u64,
    /// Interrupts raised, and passes that gave buffers back while the guest wanted none.
    pub irqs: IrqCounts,
}

/// Everything the vCPU threads (queue notifications without ioeventfds) and the device's loop
/// share, under one lock.
pub(super) struct DeviceState {
    pub(super) mem: Option<GuestMemoryMmap>,
    pub(super) queues: Vec<Queue>,
    pub(super) irq: Option<IrqLine>,
    /// Set while the VM is paused for a snapshot: no guest memory is touched.
    pub(super) paused: bool,
    /// Set when the device is dropped: the loop stops.
    pub(super) stopped: bool,
    tap: Option<Tap>,
    /// A frame read from the tap that found no guest buffer yet (the tap is edge-triggered:
    /// it is read again only once this one is delivered).
    rx_frame: Vec<u8>,
    rx_len: Option<usize>,
    tx_buf: Vec<u8>,
    pub(super) queue_events: QueueEvents,
    /// Written when a pass stops at its budget with work left: the device's loop goes on.
    kick: Arc<EventFd>,
    /// The guest accepted frames with partial checksums (otherwise header flags must be 0).
    guest_csum: bool,
    stats: NetStats,
    /// Queues given used buffers since the interrupt was last raised ([`Self::flush_irq`]).
    used_irq: UsedIrq<QUEUES>,
}

impl DeviceState {
    pub(super) fn on_queue_notify(&mut self, queue: usize) {
        if queue == TX {
            self.process_tx();
        }
        // New receive buffers: deliver what waits on the tap.
        self.process_rx();
    }

    pub(super) fn tap_readable(&mut self) {
        self.process_rx();
    }

    fn drain_queue_events(&mut self) {
        for q in 0..self.queue_events.len() {
            if self.queue_events.take(q) {
                self.on_queue_notify(q);
            }
        }
    }

    /// Work is left after a pass's budget: the device's loop takes it up after the others
    /// holding the lock had their turn.
    fn more_later(&self) {
        let _ = self.kick.write(1);
    }

    /// The device's loop's wake-up: carry on with both queues.
    pub(super) fn kicked(&mut self) {
        if self.kick.read().is_ok() {
            self.process_tx();
            self.process_rx();
        }
    }

    /// Raise the interrupt once for the queues given used buffers since the last call (see
    /// [`UsedIrq`]): called where a pass ends, so frames sent and received in one pass cost
    /// the guest one interrupt, and none while its NAPI poll is draining those queues.
    pub(super) fn flush_irq(&mut self) {
        self.used_irq
            .flush(self.irq.as_ref(), self.mem.as_ref(), &self.queues);
        self.stats.irqs = self.used_irq.counts;
    }

    /// Send every frame the guest queued.
    fn process_tx(&mut self) {
        if self.paused || self.queues.len() != QUEUES {
            return;
        }
        let Some(mem) = self.mem.clone() else { return };
        let mut used = false;
        let mut handled = 0;
        while let Some(chain) = self.queues[TX].pop_descriptor_chain(&mem) {
            handled += 1;
            if handled > BUDGET {
                self.queues[TX].go_to_previous_position();
                self.more_later();
                break;
            }
            let head = chain.head_index();
            self.tx_buf.clear();
            let read = chain.reader(&mem).ok().and_then(|mut r| {
                let len = r.available_bytes();
                if !(VNET_HDR_LEN..=MAX_FRAME).contains(&len) {
                    return None;
                }
                self.tx_buf.resize(len, 0);
                r.read_exact(&mut self.tx_buf).ok()
            });
            let _ = self.queues[TX].add_used(&mem, head, 0);
            used = true;
            let sent = match (read, &self.tap) {
                (Some(()), Some(tap)) => match tap.write_frame(&self.tx_buf) {
                    Ok(_) => true,
                    Err(e) => {
                        // A full tap queue drops the frame, as a congested link would.
                        if e.kind() != ErrorKind::WouldBlock {
                            tracing::debug!("net: writing a frame to {}: {e}", tap.name());
                        }
                        false
                    }
                },
                _ => false,
            };
            if sent {
                self.stats.tx_frames += 1;
            } else {
                self.stats.tx_dropped += 1;
            }
        }
        if used {
            self.used_irq.mark(TX);
        }
    }

    /// Move frames from the tap into the guest's receive buffers until either runs out.
    fn process_rx(&mut self) {
        if self.paused || self.queues.len() != QUEUES {
            return;
        }
        let Some(mem) = self.mem.clone() else { return };
        let Some(tap) = &self.tap else { return };
        let mut used = false;
        let mut handled = 0;
        loop {
            handled += 1;
            if handled > BUDGET {
                self.more_later();
                break;
            }
            let len = match self.rx_len {
                Some(n) => n,
                None => match tap.read_frame(&mut self.rx_frame) {
                    // A short read, or one reporting more than the buffer holds (truncated):
                    // not a frame the guest can take.
                    Ok(n) if (VNET_HDR_LEN..=MAX_FRAME).contains(&n) => n,
                    Ok(_) => {
                        self.stats.rx_dropped += 1;
                        continue;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => {
                        if e.kind() != ErrorKind::WouldBlock {
                            tracing::warn!("net: reading {}: {e}", tap.name());
                        }
                        break;
                    }
                },
            };
            self.rx_len = Some(len);
            let Some(chain) = self.queues[RX].pop_descriptor_chain(&mem) else {
                // No buffer: keep the frame until the guest posts one.
                break;
            };
            let head = chain.head_index();
            // num_buffers: always one buffer per frame (no mergeable receive buffers).
            self.rx_frame[10..12].copy_from_slice(&1u16.to_le_bytes());
            if !self.guest_csum {
                // Flags (NEEDS_CSUM, DATA_VALID) are only for a driver that accepted them.
                self.rx_frame[0] = 0;
            }
            self.rx_len = None;
            let written = chain.writer(&mem).ok().and_then(|mut w| {
                (w.available_bytes() >= len)
                    .then(|| w.write_all(&self.rx_frame[..len]).ok())
                    .flatten()
            });
            // A buffer that cannot hold the frame (too small, not writable: a driver never
            // posts one) goes back empty with the frame dropped, rather than stall receive.
            let took = if written.is_some() { len as u32 } else { 0 };
            let _ = self.queues[RX].add_used(&mem, head, took);
            used = true;
            if written.is_some() {
                self.stats.rx_frames += 1;
            } else {
                self.stats.rx_dropped += 1;
            }
        }
        if used {
            self.used_irq.mark(RX);
        }
    }
}

/// The virtio-net device: a tap (or none), and its event loop, run on a thread of its own or by
/// the VM's owner.
pub struct Net {
    state: Arc<Mutex<DeviceState>>,
    epoll: Arc<Epoll>,
    mac: Mac,
    runner: Runner,
}

impl Net {
    /// A device with guest MAC `mac`, backed by `tap` (None: no link, frames are dropped).
    pub fn new(mac: Mac, tap: Option<Tap>) -> Result<Self, DeviceError> {
        let mut n = Self::prepare(mac, tap)?;
        n.start_thread()?;
        Ok(n)
    }

    /// [`Net::new`] without its thread yet: it starts with the VM ([`VirtioDevice::start`]),
    /// as a restored vsock device's does.
    pub fn prepare(mac: Mac, tap: Option<Tap>) -> Result<Self, DeviceError> {
        let thread_err = |source| DeviceError::NetThread { source };
        let epoll = Arc::new(Epoll::new().map_err(thread_err)?);
        if let Some(tap) = &tap {
            let ev = EpollEvent::new(EventSet::IN | EventSet::EDGE_TRIGGERED, TOKEN_TAP);
            epoll
                .ctl(ControlOperation::Add, tap.as_fd().as_raw_fd(), ev)
                .map_err(thread_err)?;
        }
        let kick = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(thread_err)?);
        epoll
            .ctl(
                ControlOperation::Add,
                kick.as_raw_fd(),
                EpollEvent::new(EventSet::IN, TOKEN_KICK),
            )
            .map_err(thread_err)?;
        let state = Arc::new(Mutex::new(DeviceState {
            mem: None,
            queues: Vec::new(),
            irq: None,
            paused: false,
            stopped: false,
            tap,
            rx_frame: vec![0; MAX_FRAME],
            rx_len: None,
            tx_buf: Vec::with_capacity(MAX_FRAME),
            queue_events: QueueEvents::default(),
            kick,
            guest_csum: false,
            stats: NetStats::default(),
            used_irq: UsedIrq::default(),
        }));
        Ok(Self {
            state,
            epoll,
            mac,
            runner: Runner::NotYet,
        })
    }

    /// Its thread, if nobody runs its loop yet (see [`Net::prepare`]).
    fn start_thread(&mut self) -> Result<(), DeviceError> {
        let (state, epoll) = (&self.state, &self.epoll);
        self.runner
            .start_thread("net", || {
                let pump = event_loop::Pump::new(state.clone(), epoll.clone());
                move || pump.run()
            })
            .map_err(|source| DeviceError::NetThread { source })
    }

    fn pump(&self) -> event_loop::Pump {
        event_loop::Pump::new(self.state.clone(), self.epoll.clone())
    }

    pub fn stats(&self) -> NetStats {
        self.state.lock().unwrap().stats
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        {
            let g = &mut *self.state.lock().unwrap_or_else(|p| p.into_inner());
            g.stopped = true;
            // Now, not at its next idle wake-up: the loop lets go of guest RAM and the tap.
            let _ = g.kick.write(1);
        }
        // Waited for, so the RAM and the tap are released when the device is (see Vsock). A
        // loop handed over holds them until its owner turns it once more, which the kick asks.
        self.runner.join();
    }
}

/// The tap offloads matching what the guest accepted to receive.
fn tap_offloads(acked: u64) -> u32 {
    let mut f = 0;
    if acked & F_GUEST_CSUM != 0 {
        f |= TUN_F_CSUM;
    }
    // Segmentation offloads toward the guest are not offered (no large receive buffers), so
    // TUN_F_TSO* stay off and the host kernel segments before the tap.
    f
}

impl VirtioDevice for Net {
    fn device_type(&self) -> u32 {
        DEVICE_ID
    }

    fn start(&mut self) -> Result<(), DeviceError> {
        self.start_thread()
    }

    fn take_loop(&mut self) -> Option<Box<dyn DeviceLoop>> {
        self.runner
            .hand_over()
            .then(|| Box::new(self.pump()) as Box<dyn DeviceLoop>)
    }

    fn features(&self) -> u64 {
        F_CSUM | F_GUEST_CSUM | F_MAC | F_HOST_TSO4 | F_HOST_TSO6
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; QUEUES]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_net_config: mac[6] is all we announce (no STATUS, MQ or MTU).
        let off = offset as usize;
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.mac.get(off + i).copied().unwrap_or(0);
        }
    }

    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqLine, acked: u64) {
        let mut g = self.state.lock().unwrap();
        if let Some(tap) = &g.tap {
            if let Err(e) = tap.set_offload(tap_offloads(acked)) {
                tracing::warn!("net: {e}");
            }
        }
        g.guest_csum = acked & F_GUEST_CSUM != 0;
        g.mem = Some(mem);
        g.queues = queues;
        g.irq = Some(irq);
        // Frames may have arrived before the driver was up.
        g.process_rx();
        g.flush_irq();
    }

    fn queue_notify(&mut self, queue: u16) {
        let mut g = self.state.lock().unwrap();
        g.on_queue_notify(queue as usize);
        g.flush_irq();
    }

    fn attach_queue_events(&mut self, events: &[Arc<EventFd>]) -> bool {
        let mut g = self.state.lock().unwrap();
        g.queue_events
            .attach(&self.epoll, events, QUEUES, TOKEN_QUEUE_BASE, "net")
    }

    fn set_paused(&mut self, paused: bool) {
        let mut g = self.state.lock().unwrap();
        if paused {
            // As vsock: what the parked vCPUs signalled is handled before the snapshot.
            g.drain_queue_events();
            // Its interrupt too: nothing touches guest memory once paused.
            g.flush_irq();
        }
        g.paused = paused;
        if !paused {
            g.process_tx();
            // The tap is edge-triggered: frames that arrived while paused are read now.
            g.process_rx();
            g.flush_irq();
        }
    }

    fn queue_states(&self) -> Vec<QueueState> {
        self.state
            .lock()
            .unwrap()
            .queues
            .iter()
            .map(|q| q.state())
            .collect()
    }

    fn kind(&self) -> VirtioKind {
        VirtioKind::Net { mac: self.mac }
    }

    fn after_restore(&mut self) {
        // Buffers the guest posted before the snapshot are still posted: use them.
        let mut g = self.state.lock().unwrap();
        g.process_rx();
        g.flush_irq();
    }

    fn reset(&mut self) {
        let mut g = self.state.lock().unwrap();
        g.mem = None;
        g.queues.clear();
        g.irq = None;
        g.rx_len = None;
        g.used_irq.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;
    use std::process::Command;
    use std::time::{Duration, Instant};
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    const GUEST_MAC: Mac = [0x06, 0, 0x0a, 0x09, 0, 2];
    const TAP_MAC: &str = "06:00:0a:09:00:01";

    /// Queue `q`'s descriptor table; available ring 4 KiB above, used ring 8 KiB above.
    fn ring(q: usize) -> u64 {
        0x1_0000 + q as u64 * 0x1_0000
    }

    /// Post descriptor `d` (one buffer of `len` bytes at `addr`) as available entry `d`.
    fn post(mem: &GuestMemoryMmap, q: usize, d: u16, addr: u64, len: u32) {
        let desc = ring(q) + d as u64 * 16;
        mem.write_obj(addr, GuestAddress(desc)).unwrap();
        mem.write_obj(len, GuestAddress(desc + 8)).unwrap();
        let writable: u16 = if q == RX { 2 } else { 0 };
        mem.write_obj(writable, GuestAddress(desc + 12)).unwrap();
        mem.write_obj(d, GuestAddress(ring(q) + 0x1000 + 4 + d as u64 * 2))
            .unwrap();
        mem.write_obj(d + 1, GuestAddress(ring(q) + 0x1000 + 2))
            .unwrap();
    }

    fn used(mem: &GuestMemoryMmap, q: usize) -> u16 {
        mem.read_obj(GuestAddress(ring(q) + 0x2000 + 2)).unwrap()
    }

    fn used_len(mem: &GuestMemoryMmap, q: usize, i: u16) -> u32 {
        mem.read_obj(GuestAddress(ring(q) + 0x2000 + 4 + i as u64 * 8 + 4))
            .unwrap()
    }

    fn activated(tap: Option<Tap>) -> (Net, GuestMemoryMmap) {
        let mut net = Net::new(GUEST_MAC, tap).unwrap();
        let mem = activate(&mut net);
        (net, mem)
    }

    /// Activate `net` over 1 MiB of guest memory with both rings set up; returns that memory.
    fn activate(net: &mut Net) -> GuestMemoryMmap {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let queues = (0..2)
            .map(|q| {
                let mut queue = Queue::new(QUEUE_SIZE).unwrap();
                queue.set_size(16);
                queue.set_desc_table_address(Some(ring(q) as u32), Some(0));
                queue.set_avail_ring_address(Some(ring(q) as u32 + 0x1000), Some(0));
                queue.set_used_ring_address(Some(ring(q) as u32 + 0x2000), Some(0));
                queue.set_ready(true);
                queue
            })
            .collect();
        let irq = IrqLine::new(EventFd::new(EFD_NONBLOCK).unwrap());
        net.activate(mem.clone(), queues, irq, net.features());
        mem
    }

    /// How many times the device's interrupt line was raised since the last look.
    fn raised(net: &Net) -> u64 {
        let irq = net.state.lock().unwrap().irq.clone().unwrap();
        irq.eventfd().read().unwrap_or(0)
    }

    fn ip(args: &str) {
        let st = Command::new("ip")
            .args(args.split_whitespace())
            .status()
            .expect("running ip");
        assert!(st.success(), "ip {args}");
    }

    /// This thread in a network namespace of its own with tap0 at 10.9.0.1/24; the guest is
    /// 10.9.0.2. None where namespaces or taps are not allowed (not root).
    fn tap_in_own_netns() -> Option<Tap> {
        // SAFETY: unshare of the network namespace affects this thread only.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            eprintln!(
                "skipped: unshare(CLONE_NEWNET): {}",
                std::io::Error::last_os_error()
            );
            return None;
        }
        // No IPv6 neighbour discovery frames among the ones the test counts.
        for conf in ["all", "default"] {
            let knob = format!("/proc/sys/net/ipv6/conf/{conf}/disable_ipv6");
            let _ = std::fs::write(knob, "1");
        }
        let tap = Tap::open("tap0").expect("opening tap0 in a fresh namespace");
        // `ip` forks from this thread, so it runs in the new namespace.
        ip(&format!("link set tap0 address {TAP_MAC}"));
        ip("link set lo up");
        ip("link set tap0 up");
        ip("addr add 10.9.0.1/24 dev tap0");
        ip("neigh add 10.9.0.2 lladdr 06:00:0a:09:00:02 dev tap0");
        Some(tap)
    }

    /// An Ethernet + IPv4 + UDP frame from the guest (10.9.0.2:5000) to 10.9.0.1:`port`,
    /// after an all-zero virtio-net header.
    fn guest_udp_frame(port: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; VNET_HDR_LEN];
        f.extend_from_slice(&[0x06, 0, 0x0a, 0x09, 0, 1]);
        f.extend_from_slice(&GUEST_MAC);
        f.extend_from_slice(&[0x08, 0x00]);
        let total = (20 + 8 + payload.len()) as u16;
        let mut iph = vec![0x45, 0];
        iph.extend_from_slice(&total.to_be_bytes());
        iph.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0, 10, 9, 0, 2, 10, 9, 0, 1]);
        let sum = iph
            .chunks(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]) as u32)
            .sum::<u32>();
        let sum = !(((sum & 0xffff) + (sum >> 16)) as u16);
        iph[10..12].copy_from_slice(&sum.to_be_bytes());
        f.extend_from_slice(&iph);
        f.extend_from_slice(&5000u16.to_be_bytes());
        f.extend_from_slice(&port.to_be_bytes());
        f.extend_from_slice(&(8 + payload.len() as u16).to_be_bytes());
        f.extend_from_slice(&[0, 0]); // no UDP checksum
        f.extend_from_slice(payload);
        f
    }

    fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(5), "timed out: {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn frames_pass_between_the_guest_queues_and_the_tap() {
        let Some(tap) = tap_in_own_netns() else {
            return;
        };
        let (mut net, mem) = activated(Some(tap));

        // Guest → host: a UDP datagram on the transmit queue reaches a host socket.
        let host = UdpSocket::bind("10.9.0.1:7000").unwrap();
        host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let frame = guest_udp_frame(7000, b"hello from the guest");
        mem.write_slice(&frame, GuestAddress(0x8_0000)).unwrap();
        post(&mem, TX, 0, 0x8_0000, frame.len() as u32);
        net.queue_notify(TX as u16);
        let mut buf = [0u8; 64];
        let (n, from) = host.recv_from(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello from the guest");
        assert_eq!(from.to_string(), "10.9.0.2:5000");
        assert_eq!(used(&mem, TX), 1);

        // Host → guest, while paused: nothing is written until the VM runs again.
        net.set_paused(true);
        host.send_to(b"hello from the host", "10.9.0.2:5000")
            .unwrap();
        post(&mem, RX, 0, 0x9_0000, 2048);
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(used(&mem, RX), 0, "no guest memory written while paused");
        net.set_paused(false);
        wait_until("the frame reaches the receive queue", || {
            used(&mem, RX) == 1
        });
        let len = used_len(&mem, RX, 0) as usize;
        let mut got = vec![0u8; len];
        mem.read_slice(&mut got, GuestAddress(0x9_0000)).unwrap();
        assert_eq!(&got[10..12], &1u16.to_le_bytes(), "num_buffers");
        assert_eq!(&got[VNET_HDR_LEN..VNET_HDR_LEN + 6], &GUEST_MAC);
        assert!(got.ends_with(b"hello from the host"), "{got:?}");
        assert_eq!(net.stats().rx_frames, 1);
        assert_eq!(net.stats().tx_frames, 1);

        // Buffers a driver would never post (too small for the frame, or not writable) come
        // back empty with the frame dropped, instead of stalling receive.
        post(&mem, RX, 1, 0xA_0000, 40);
        host.send_to(b"too big for forty bytes with headers", "10.9.0.2:5000")
            .unwrap();
        wait_until("the small buffer is returned", || used(&mem, RX) == 2);
        assert_eq!(used_len(&mem, RX, 1), 0);
        assert_eq!(net.stats().rx_dropped, 1);
        post(&mem, RX, 2, 0xB_0000, 2048);
        mem.write_obj(0u16, GuestAddress(ring(RX) + 2 * 16 + 12))
            .unwrap();
        host.send_to(b"x", "10.9.0.2:5000").unwrap();
        wait_until("the read-only buffer is returned", || used(&mem, RX) == 3);
        assert_eq!(used_len(&mem, RX, 2), 0);
        assert_eq!(net.stats().rx_dropped, 2);
    }

    /// A device whose loop the VM's owner runs starts no thread: a frame from the host waits
    /// until the owner, woken by the loop's descriptor, turns it; once the device is gone the
    /// loop says so.
    #[test]
    fn a_loop_handed_to_the_owner_moves_frames_when_turned() {
        let Some(tap) = tap_in_own_netns() else {
            return;
        };
        let mut net = Net::prepare(GUEST_MAC, Some(tap)).unwrap();
        let mut l = net.take_loop().expect("a loop to hand over");
        assert!(
            l.first_wait() > Duration::ZERO,
            "waits before its first turn"
        );
        assert!(net.take_loop().is_none(), "handed over once");
        net.start().unwrap();
        assert!(matches!(net.runner, Runner::Handed), "no thread started");
        let mem = activate(&mut net);
        post(&mem, RX, 0, 0x9_0000, 2048);
        let host = UdpSocket::bind("10.9.0.1:7001").unwrap();
        host.send_to(b"for the owner to deliver", "10.9.0.2:5000")
            .unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(used(&mem, RX), 0, "nothing runs the loop but its owner");
        crate::devices::virtio::turn_until(&mut *l, || used(&mem, RX) == 1);
        let mut got = vec![0u8; used_len(&mem, RX, 0) as usize];
        mem.read_slice(&mut got, GuestAddress(0x9_0000)).unwrap();
        assert!(got.ends_with(b"for the owner to deliver"), "{got:?}");
        drop(net);
        assert!(l.turn().is_none(), "a dropped device's loop has stopped");
    }

    #[test]
    fn without_a_tap_the_guest_sends_into_nothing() {
        let (mut net, mem) = activated(None);
        let frame = guest_udp_frame(7000, b"lost");
        mem.write_slice(&frame, GuestAddress(0x8_0000)).unwrap();
        post(&mem, TX, 0, 0x8_0000, frame.len() as u32);
        net.queue_notify(TX as u16);
        assert_eq!(used(&mem, TX), 1, "the buffer is returned");
        assert_eq!(net.stats().tx_dropped, 1);
        assert_eq!(raised(&net), 1);
        // A driver polling its transmit queue (NAPI) has asked for no interrupt: none comes.
        mem.write_obj(1u16, GuestAddress(ring(TX) + 0x1000))
            .unwrap();
        post(&mem, TX, 1, 0x8_0000, frame.len() as u32);
        net.queue_notify(TX as u16);
        assert_eq!(used(&mem, TX), 2);
        assert_eq!(raised(&net), 0);
        let irqs = net.stats().irqs;
        assert_eq!((irqs.raised, irqs.not_wanted), (1, 1));
        assert_eq!(
            net.kind(),
            VirtioKind::Net { mac: GUEST_MAC },
            "the MAC travels with snapshots"
        );
        let mut mac = [0u8; 8];
        net.read_config(0, &mut mac);
        assert_eq!(&mac[..6], &GUEST_MAC);
        assert_eq!(&mac[6..], &[0, 0]);
    }

    #[test]
    fn hostile_tap_names_are_refused() {
        for bad in ["", "a-name-longer-than-15", "../x", "tap 0", "tap\n"] {
            assert!(
                matches!(
                    Tap::open(bad),
                    Err(crate::devices::virtio::net::TapError::Name(_))
                ),
                "{bad:?}"
            );
        }
    }
}
