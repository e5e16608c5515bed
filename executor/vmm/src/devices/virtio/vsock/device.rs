//! The virtio device: its config space (the guest CID), the RX/TX/event virtqueues and moving
//! packets between them and the muxer, pause for snapshots, and the transport reset sent after
//! a restore. The device thread lives in `event_loop`.

use std::io::{Read, Write};
use std::num::Wrapping;
use std::path::Path;
use std::sync::{Arc, Mutex};

use virtio_queue::{Queue, QueueOwnedT, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::first_call::FirstCall;
use super::muxer::Muxer;
use super::packet::{Header, HDR_LEN, MAX_PKT, OP_REQUEST, OP_RESPONSE, OP_RW};
use super::{event_loop, DEVICE_ID, HOST_CID};
use crate::devices::virtio::queue_events::QueueEvents;
use crate::devices::virtio::runner::Runner;
use crate::devices::virtio::used_irq::UsedIrq;
use crate::devices::virtio::{IrqLine, VirtioDevice};
use crate::error::DeviceError;
use crate::snapshot::devices::VirtioKind;

const QUEUE_SIZE: u16 = 256;
/// Receive, transmit and event.
pub const QUEUES: usize = 3;
const RX: usize = 0;
const TX: usize = 1;
const EVT: usize = 2;
const EVENT_TRANSPORT_RESET: u32 = 0;

/// Epoll token of queue `q`'s notification eventfd: `TOKEN_QUEUE_BASE + q`, far above the
/// muxer's tokens (the listener, then one per connection counting up from 1).
pub(super) const TOKEN_QUEUE_BASE: u64 = 1 << 63;
/// Epoll token of the eventfd that tells the thread the device is gone.
pub(super) const TOKEN_STOP: u64 = TOKEN_QUEUE_BASE - 1;

/// Everything the vCPU threads (queue notifications without ioeventfds) and the device thread
/// (host streams, and queue notifications through ioeventfds) share, under one lock.
pub(super) struct DeviceState {
    pub(super) mem: Option<GuestMemoryMmap>,
    pub(super) queues: Vec<Queue>,
    pub(super) irq: Option<IrqLine>,
    /// Set while the VM is paused for a snapshot: no guest memory is touched.
    pub(super) paused: bool,
    pub(super) muxer: Muxer,
    /// One eventfd per queue that KVM signals when the guest notifies it.
    pub(super) queue_events: QueueEvents,
    /// The device was dropped: its thread lets go of guest RAM and the sockets and ends.
    pub(super) stopped: bool,
    /// A transport reset the guest has not taken yet. Nothing goes into its receive queue
    /// until it has (it re-posts the event buffer and notifies that queue): a connection it
    /// accepted first would be reset by its own handling of the event, which Linux runs from
    /// a separate work item, in no set order with received packets.
    /// Holds the event queue's available index as the reset was sent: only a notification that
    /// finds the guest has moved it past that counts (one already pending from before the
    /// snapshot does not).
    pub(super) reset_unacked: Option<Wrapping<u16>>,
    /// Where host stream data is read before it is copied into a guest buffer. Kept, and only
    /// as long as the largest guest buffer seen (Linux posts 4 KiB ones): a fresh 64 KiB
    /// buffer per fill made its pages private in every child and was zeroed each time.
    pub(super) rx_scratch: Vec<u8>,
    /// A restored device's first host call, step by step, for the log.
    pub(super) first_call: FirstCall,
    /// Queues given used buffers since the interrupt was last raised ([`Self::flush_irq`]).
    pub(super) used_irq: UsedIrq<QUEUES>,
}

impl DeviceState {
    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqLine) {
        self.mem = Some(mem);
        self.queues = queues;
        self.irq = Some(irq);
    }

    /// The guest made buffers available on `queue`, whichever way the notification came.
    pub(super) fn on_queue_notify(&mut self, queue: usize) {
        self.first_call.mark("guest notified");
        if queue == TX {
            self.process_tx();
        }
        if queue == EVT {
            if let (Some(sent_at), Some(mem)) = (self.reset_unacked, &self.mem) {
                // The guest handled the reset and gave the buffer back.
                let now = self.queues[EVT].avail_idx(mem, std::sync::atomic::Ordering::Acquire);
                if now.is_ok_and(|now| now != sent_at) {
                    self.reset_unacked = None;
                    self.first_call.mark("reset taken");
                }
            }
        }
        // New receive buffers, or answers queued by the packets just read.
        self.process_rx();
    }

    /// Handle every notification already signalled through the eventfds, now, on this thread.
    fn drain_queue_events(&mut self) {
        for q in 0..self.queue_events.len() {
            if self.queue_events.take(q) {
                self.on_queue_notify(q);
            }
        }
    }

    /// Drain the guest's transmit queue.
    fn process_tx(&mut self) {
        if self.paused {
            return;
        }
        let Some(mem) = self.mem.clone() else { return };
        let mut used = false;
        while let Some(chain) = self.queues[TX].pop_descriptor_chain(&mem) {
            let head = chain.head_index();
            let packet = chain.reader(&mem).ok().and_then(|mut r| {
                let mut hb = [0u8; HDR_LEN];
                r.read_exact(&mut hb).ok()?;
                let h = Header::parse(&hb);
                if h.len > MAX_PKT || h.len as usize > r.available_bytes() {
                    return Some((h, None));
                }
                let mut payload = vec![0u8; h.len as usize];
                r.read_exact(&mut payload).ok()?;
                Some((h, Some(payload)))
            });
            let _ = self.queues[TX].add_used(&mem, head, 0);
            used = true;
            match packet {
                Some((h, Some(payload))) => {
                    match h.op {
                        OP_RESPONSE => self.first_call.mark("accepted"),
                        OP_RW => {
                            if let Some(line) = self.first_call.answered(self.used_irq.counts) {
                                // One write; a log that cannot be written costs only the line.
                                let _ = std::io::stderr().write_all(line.as_bytes());
                            }
                        }
                        _ => {}
                    }
                    self.muxer.on_guest_packet(h, &payload)
                }
                Some((h, None)) => {
                    tracing::warn!(len = h.len, "vsock: oversized or truncated guest packet");
                    self.muxer.rst_for(&h);
                }
                None => tracing::warn!("vsock: unreadable guest packet"),
            }
        }
        if used {
            self.used_irq.mark(TX);
        }
    }

    /// Raise the interrupt once for the queues given used buffers since the last call (see
    /// [`UsedIrq`]). Called where a pass over the queues ends, so a pass that gives back
    /// transmit and receive buffers, or several receive fills, costs the guest one interrupt.
    pub(super) fn flush_irq(&mut self) {
        self.used_irq
            .flush(self.irq.as_ref(), self.mem.as_ref(), &self.queues);
    }

    /// Fill the guest's receive queue: control packets first, then stream data within credit.
    pub(super) fn process_rx(&mut self) {
        if self.paused || self.reset_unacked.is_some() {
            return;
        }
        let Some(mem) = self.mem.clone() else { return };
        let mut used = false;
        while let Some(chain) = self.queues[RX].pop_descriptor_chain(&mem) {
            let head = chain.head_index();
            let Ok(mut w) = chain.writer(&mem) else {
                let _ = self.queues[RX].add_used(&mem, head, 0);
                used = true;
                continue;
            };
            let room = w
                .available_bytes()
                .saturating_sub(HDR_LEN)
                .min(MAX_PKT as usize);
            if self.rx_scratch.len() < room {
                self.rx_scratch.resize(room, 0);
            }
            let buf = &mut self.rx_scratch[..room];
            let Some((h, n)) = self.muxer.next_for_guest(room, buf) else {
                // Nothing to send: give the buffer back for later.
                self.queues[RX].go_to_previous_position();
                break;
            };
            if h.op == OP_REQUEST {
                self.first_call.mark("request given");
            }
            let _ = w.write_all(&h.to_bytes());
            if n > 0 {
                let _ = w.write_all(&buf[..n]);
            }
            let _ = self.queues[RX].add_used(&mem, head, (HDR_LEN + n) as u32);
            used = true;
        }
        if used {
            self.used_irq.mark(RX);
        }
    }

    /// Connections did not survive the snapshot: tell the guest so it drops its side (its
    /// listeners stay). Needs one of the event buffers the guest keeps posted.
    fn send_transport_reset(&mut self) {
        let Some(mem) = self.mem.clone() else { return };
        let Some(chain) = self.queues[EVT].pop_descriptor_chain(&mem) else {
            tracing::warn!("vsock: no event buffer for the transport reset");
            return;
        };
        let head = chain.head_index();
        let avail = self.queues[EVT].avail_idx(&mem, std::sync::atomic::Ordering::Acquire);
        let ok = chain
            .writer(&mem)
            .ok()
            .and_then(|mut w| w.write_all(&EVENT_TRANSPORT_RESET.to_le_bytes()).ok())
            .is_some();
        let _ = self.queues[EVT].add_used(&mem, head, if ok { 4 } else { 0 });
        self.reset_unacked = if ok { avail.ok() } else { None };
        self.used_irq.mark(EVT);
    }
}

/// The vsock device: owns the host socket and an event loop that moves host stream data, run
/// on a thread of its own or by the VM's owner.
pub struct Vsock {
    state: Arc<Mutex<DeviceState>>,
    guest_cid: u64,
    /// Wakes the loop when the device is dropped (see `Drop`).
    stop: EventFd,
    runner: Runner,
}

impl Vsock {
    /// Listen on `uds_path` (replaced if a stale socket is there) for guest `guest_cid`.
    pub fn new(guest_cid: u64, uds_path: &Path) -> Result<Self, DeviceError> {
        let mut v = Self::prepare(guest_cid, uds_path)?;
        v.start_thread()?;
        Ok(v)
    }

    /// [`Vsock::new`] without its thread yet: the socket listens, and the thread starts with
    /// the VM ([`VirtioDevice::start`]). A VMM that switches users before it starts its VM
    /// then has no other thread glibc must take through each id change.
    pub fn prepare(guest_cid: u64, uds_path: &Path) -> Result<Self, DeviceError> {
        // 0-2 are the hypervisor, local and host; the top of the 32-bit range is reserved too.
        const MAX_CID: u64 = u32::MAX as u64 - 1;
        if guest_cid <= HOST_CID || guest_cid > MAX_CID {
            return Err(DeviceError::VsockCid {
                cid: guest_cid,
                max: MAX_CID,
            });
        }
        let socket_err = |source| DeviceError::VsockSocket {
            path: uds_path.to_path_buf(),
            source,
        };
        let muxer = Muxer::bind(guest_cid, uds_path).map_err(socket_err)?;
        let epoll = muxer.epoll();
        let state = Arc::new(Mutex::new(DeviceState {
            mem: None,
            queues: Vec::new(),
            irq: None,
            paused: false,
            muxer,
            queue_events: QueueEvents::default(),
            stopped: false,
            reset_unacked: None,
            rx_scratch: Vec::new(),
            first_call: FirstCall::default(),
            used_irq: UsedIrq::default(),
        }));
        let stop = EventFd::new(libc::EFD_NONBLOCK)
            .map_err(|source| DeviceError::VsockThread { source })?;
        epoll
            .ctl(
                vmm_sys_util::epoll::ControlOperation::Add,
                std::os::fd::AsRawFd::as_raw_fd(&stop),
                vmm_sys_util::epoll::EpollEvent::new(vmm_sys_util::epoll::EventSet::IN, TOKEN_STOP),
            )
            .map_err(|source| DeviceError::VsockThread { source })?;
        Ok(Self {
            state,
            guest_cid,
            stop,
            runner: Runner::NotYet,
        })
    }

    /// Its thread, if nobody runs its loop yet (see [`Vsock::prepare`]).
    fn start_thread(&mut self) -> Result<(), DeviceError> {
        let state = &self.state;
        self.runner
            .start_thread("vsock", || {
                let pump = pump(state);
                move || pump.run()
            })
            .map_err(|source| DeviceError::VsockThread { source })
    }
}

fn pump(state: &Arc<Mutex<DeviceState>>) -> event_loop::Pump {
    let epoll = state.lock().unwrap().muxer.epoll();
    event_loop::Pump::new(state.clone(), epoll)
}

impl Drop for Vsock {
    /// The thread holds guest RAM and the host sockets: without this, a VM run inside a
    /// long-lived process (a parent booted by the executor) would keep its RAM mapped after
    /// it stopped.
    /// The thread is waited for, so once the device is gone its RAM and sockets are too (not
    /// whenever the thread is next scheduled; found by the virtio fuzz target, whose devices
    /// came and went faster than their threads).
    fn drop(&mut self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).stopped = true;
        let _ = self.stop.write(1);
        self.runner.join();
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        DEVICE_ID
    }

    fn start(&mut self) -> Result<(), DeviceError> {
        self.start_thread()
    }

    fn take_loop(&mut self) -> Option<Box<dyn crate::devices::virtio::DeviceLoop>> {
        self.runner
            .hand_over()
            .then(|| Box::new(pump(&self.state)) as Box<dyn crate::devices::virtio::DeviceLoop>)
    }

    fn features(&self) -> u64 {
        0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; QUEUES]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let config = self.guest_cid.to_le_bytes();
        let off = offset as usize;
        for (i, b) in data.iter_mut().enumerate() {
            *b = config.get(off + i).copied().unwrap_or(0);
        }
    }

    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqLine, _features: u64) {
        self.state.lock().unwrap().activate(mem, queues, irq);
    }

    fn activate_restored(
        &mut self,
        mem: GuestMemoryMmap,
        queues: Vec<Queue>,
        irq: IrqLine,
        _features: u64,
    ) {
        // Under one lock: between the two, the device thread could fill the receive queue
        // (a host connection that arrived before the restore), and the guest would then drop
        // the connection it had just accepted while the host waits on it.
        let mut g = self.state.lock().unwrap();
        g.activate(mem, queues, irq);
        g.first_call.start();
        g.send_transport_reset();
        g.flush_irq();
    }

    fn queue_notify(&mut self, queue: u16) {
        let mut g = self.state.lock().unwrap();
        g.on_queue_notify(queue as usize);
        g.flush_irq();
    }

    fn attach_queue_events(&mut self, events: &[Arc<EventFd>]) -> bool {
        let mut g = self.state.lock().unwrap();
        let epoll = g.muxer.epoll();
        let queues = self.queue_max_sizes().len();
        g.queue_events
            .attach(&epoll, events, queues, TOKEN_QUEUE_BASE, "vsock")
    }

    fn set_paused(&mut self, paused: bool) {
        let mut g = self.state.lock().unwrap();
        if paused {
            // The vCPUs are parked: what they notified through the eventfds is handled now, as
            // it would have been on the vCPU thread, so the snapshot holds no unseen buffers.
            g.drain_queue_events();
            // Its interrupt too: nothing touches guest memory once paused.
            g.flush_irq();
        }
        g.paused = paused;
        if !paused {
            // Work that arrived while paused.
            g.process_tx();
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
        VirtioKind::Vsock {
            guest_cid: self.guest_cid,
        }
    }

    fn after_restore(&mut self) {
        let mut g = self.state.lock().unwrap();
        g.send_transport_reset();
        g.flush_irq();
    }

    fn reset(&mut self) {
        let mut g = self.state.lock().unwrap();
        g.muxer.reset();
        g.mem = None;
        g.queues.clear();
        g.irq = None;
        g.reset_unacked = None;
        g.used_irq.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::virtio::vsock::packet::{OP_REQUEST, TYPE_STREAM};
    use std::os::unix::net::UnixListener;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EFD_NONBLOCK;

    /// Queue `q`'s descriptor table; available ring 4 KiB above, used ring 8 KiB above.
    fn ring(q: usize) -> u64 {
        0x1_0000 + q as u64 * 0x1_0000
    }

    /// Dropping the device ends its thread before drop returns: nothing holds its state (guest
    /// RAM, the socket, the connections) any more then, not whenever the thread next runs
    /// (regression: the virtio fuzz target's devices outlived themselves by thousands of
    /// threads).
    #[test]
    fn a_dropped_device_has_let_go_of_its_state() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        for _ in 0..50 {
            let v = Vsock::new(3, &uds).unwrap();
            std::os::unix::net::UnixStream::connect(&uds).expect("listening while it lives");
            let state = Arc::downgrade(&v.state);
            drop(v);
            assert!(
                state.upgrade().is_none(),
                "its thread still holds the device"
            );
        }
    }

    /// An activated device with no device thread, so nothing consumes its queue events
    /// behind the test's back.
    fn activated_without_thread(uds: &Path) -> (Vsock, GuestMemoryMmap) {
        let state = DeviceState {
            mem: None,
            queues: Vec::new(),
            irq: None,
            paused: false,
            muxer: Muxer::bind(3, uds).unwrap(),
            queue_events: QueueEvents::default(),
            stopped: false,
            reset_unacked: None,
            rx_scratch: Vec::new(),
            first_call: FirstCall::default(),
            used_irq: UsedIrq::default(),
        };
        let mut v = Vsock {
            state: Arc::new(Mutex::new(state)),
            guest_cid: 3,
            stop: EventFd::new(EFD_NONBLOCK).unwrap(),
            runner: Runner::NotYet,
        };
        let (mem, queues, irq) = guest_rings();
        v.activate(mem.clone(), queues, irq, 0);
        (v, mem)
    }

    /// Guest memory with the three queues laid out at [`ring`], and an interrupt line.
    fn guest_rings() -> (GuestMemoryMmap, Vec<Queue>, IrqLine) {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let queues = (0..3)
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
        (mem, queues, irq)
    }

    /// One OP_REQUEST from guest port 1234 to host port `port` on the transmit queue.
    fn post_connect_request(mem: &GuestMemoryMmap, port: u32) {
        let h = Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 1234,
            dst_port: port,
            type_: TYPE_STREAM,
            op: OP_REQUEST,
            buf_alloc: 4096,
            ..Default::default()
        };
        let packet = 0x8_0000u64;
        mem.write_slice(&h.to_bytes(), GuestAddress(packet))
            .unwrap();
        let tx = ring(TX);
        mem.write_obj(packet, GuestAddress(tx)).unwrap();
        mem.write_obj(HDR_LEN as u32, GuestAddress(tx + 8)).unwrap();
        mem.write_obj(0u16, GuestAddress(tx + 0x1000 + 4)).unwrap();
        mem.write_obj(1u16, GuestAddress(tx + 0x1000 + 2)).unwrap();
    }

    #[test]
    fn pausing_handles_notifications_already_signalled() {
        // The vCPU notified through KVM and parked before the device thread woke: the pause
        // for a snapshot must take the packet, or the snapshot holds a transmit buffer that no
        // restored child would ever be told about.
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let host_port = UnixListener::bind(dir.path().join("v.sock_77")).unwrap();
        host_port.set_nonblocking(true).unwrap();
        let (mut v, mem) = activated_without_thread(&uds);
        let events: Vec<Arc<EventFd>> = (0..3)
            .map(|_| Arc::new(EventFd::new(EFD_NONBLOCK).unwrap()))
            .collect();
        assert!(v.attach_queue_events(&events));
        assert!(!v.attach_queue_events(&events), "attached once only");
        post_connect_request(&mem, 77);
        events[TX].write(1).unwrap();

        v.set_paused(true);
        assert_eq!(v.queue_states()[TX].next_avail, 1, "the packet was taken");
        assert!(host_port.accept().is_ok(), "and acted on");
        assert!(events[TX].read().is_err(), "the notification was consumed");
    }

    /// Make descriptor `desc` of queue `q` a buffer of `len` bytes at `addr`, writable by the
    /// device, and the `nth` (from 0) entry of its available ring.
    fn post_buffer(mem: &GuestMemoryMmap, q: usize, desc: u16, addr: u64, len: u32, nth: u16) {
        let d = ring(q) + desc as u64 * 16;
        mem.write_obj(addr, GuestAddress(d)).unwrap();
        mem.write_obj(len, GuestAddress(d + 8)).unwrap();
        mem.write_obj(2u16, GuestAddress(d + 12)).unwrap(); // VRING_DESC_F_WRITE
        let avail = ring(q) + 0x1000;
        mem.write_obj(desc, GuestAddress(avail + 4 + 2 * (nth as u64 % 16)))
            .unwrap();
        mem.write_obj(nth + 1, GuestAddress(avail + 2)).unwrap();
    }

    fn used_idx(mem: &GuestMemoryMmap, q: usize) -> u16 {
        mem.read_obj(GuestAddress(ring(q) + 0x2000 + 2)).unwrap()
    }

    #[test]
    fn nothing_reaches_the_guest_before_it_takes_the_transport_reset() {
        // Seen in the lab: the host's first connection to a restored agent was accepted by
        // the guest, then reset by the guest's own handling of the transport reset.
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let (mut v, mem) = activated_without_thread(&uds);
        post_buffer(&mem, EVT, 0, 0x9_0000, 4, 0);
        post_buffer(&mem, RX, 0, 0xa_0000, 4096, 0);
        v.after_restore();
        assert_eq!(used_idx(&mem, EVT), 1, "the reset was sent");
        let mut client = std::os::unix::net::UnixStream::connect(&uds).unwrap();
        client.write_all(b"CONNECT 52\n").unwrap();
        {
            let mut g = v.state.lock().unwrap();
            g.muxer.accept();
            let token = *g.muxer.conns.keys().next().unwrap();
            g.muxer
                .on_stream_event(token, vmm_sys_util::epoll::EventSet::IN);
            g.process_rx();
        }
        assert_eq!(
            used_idx(&mem, RX),
            0,
            "held back while the reset is untaken"
        );
        // The guest handled the event: it gives the buffer back and notifies the queue.
        post_buffer(&mem, EVT, 0, 0x9_0000, 4, 1);
        v.queue_notify(EVT as u16);
        assert_eq!(used_idx(&mem, RX), 1, "then the connection request goes in");
        let mut hb = [0u8; HDR_LEN];
        mem.read_slice(&mut hb, GuestAddress(0xa_0000)).unwrap();
        assert_eq!(Header::parse(&hb).op, OP_REQUEST);
    }

    /// Wait (at most 10 s) until `done` holds of the device's state.
    fn wait_for(v: &Vsock, done: impl Fn(&DeviceState) -> bool) {
        let t0 = std::time::Instant::now();
        while !done(&v.state.lock().unwrap()) {
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "the device thread did not get there"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    #[test]
    fn a_connection_from_before_the_restore_waits_for_the_reset_with_the_thread_running() {
        // As in a restored VMM: the device thread runs, and a host client connected before
        // the vCPUs started. Its request is held until the guest has taken the reset, however
        // the thread's work falls around the activation.
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let mut v = Vsock::new(3, &uds).unwrap();
        let mut first = std::os::unix::net::UnixStream::connect(&uds).unwrap();
        first.write_all(b"CONNECT 52\n").unwrap();
        wait_for(&v, |g| g.muxer.ctrl.len() == 1);
        let (mem, queues, irq) = guest_rings();
        post_buffer(&mem, EVT, 0, 0x9_0000, 4, 0);
        post_buffer(&mem, RX, 0, 0xa_0000, 4096, 0);
        v.activate_restored(mem.clone(), queues, irq, 0);
        assert_eq!(used_idx(&mem, EVT), 1, "the reset was sent");
        // A second client wakes the thread, which fills the receive queue if it may, under
        // the same lock as it reads the request.
        let mut second = std::os::unix::net::UnixStream::connect(&uds).unwrap();
        second.write_all(b"CONNECT 53\n").unwrap();
        wait_for(&v, |g| g.muxer.ctrl.len() == 2 || used_idx(&mem, RX) > 0);
        assert_eq!(
            used_idx(&mem, RX),
            0,
            "held back while the reset is untaken"
        );
        post_buffer(&mem, EVT, 0, 0x9_0000, 4, 1);
        v.queue_notify(EVT as u16);
        assert_eq!(used_idx(&mem, RX), 1, "then the oldest request goes in");
        let mut hb = [0u8; HDR_LEN];
        mem.read_slice(&mut hb, GuestAddress(0xa_0000)).unwrap();
        let h = Header::parse(&hb);
        assert_eq!((h.op, h.dst_port), (OP_REQUEST, 52));
    }

    /// A device whose loop the VM's owner runs starts no thread: a host connection waits
    /// until the owner, woken by the loop's descriptor, turns it; once the device is gone the
    /// loop says so.
    #[test]
    fn a_loop_handed_to_the_owner_serves_connections_when_turned() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let mut v = Vsock::prepare(3, &uds).unwrap();
        let mut l = v.take_loop().expect("a loop to hand over");
        assert!(
            l.first_wait() > std::time::Duration::ZERO,
            "waits before its first turn"
        );
        assert!(v.take_loop().is_none(), "handed over once");
        v.start().unwrap();
        assert!(matches!(v.runner, Runner::Handed), "no thread started");
        let (mem, queues, irq) = guest_rings();
        post_buffer(&mem, RX, 0, 0xa_0000, 4096, 0);
        v.activate(mem.clone(), queues, irq, 0);
        let mut client = std::os::unix::net::UnixStream::connect(&uds).unwrap();
        client.write_all(b"CONNECT 52\n").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(used_idx(&mem, RX), 0, "nothing runs the loop but its owner");
        crate::devices::virtio::turn_until(&mut *l, || used_idx(&mem, RX) == 1);
        let mut hb = [0u8; HDR_LEN];
        mem.read_slice(&mut hb, GuestAddress(0xa_0000)).unwrap();
        let h = Header::parse(&hb);
        assert_eq!((h.op, h.dst_port), (OP_REQUEST, 52));
        drop(v);
        assert!(l.turn().is_none(), "a dropped device's loop has stopped");
    }

    #[test]
    fn a_kick_pending_from_before_the_snapshot_does_not_count_as_taking_the_reset() {
        // The snapshot can hold an event-queue notification the guest made before it was
        // paused; delivered after the restore, it says nothing about the new reset.
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let (mut v, mem) = activated_without_thread(&uds);
        post_buffer(&mem, EVT, 0, 0x9_0000, 4, 0);
        v.after_restore();
        v.queue_notify(EVT as u16);
        assert!(
            v.state.lock().unwrap().reset_unacked.is_some(),
            "the guest has not given the buffer back yet"
        );
        post_buffer(&mem, EVT, 0, 0x9_0000, 4, 1);
        v.queue_notify(EVT as u16);
        assert!(v.state.lock().unwrap().reset_unacked.is_none());
    }

    /// How many times the device's interrupt line was raised since the last look.
    fn raised(v: &Vsock) -> u64 {
        let irq = v.state.lock().unwrap().irq.clone().unwrap();
        irq.eventfd().read().unwrap_or(0)
    }

    /// Set or clear `VRING_AVAIL_F_NO_INTERRUPT` on queue `q`, as a driver draining it does.
    fn suppress_interrupts(mem: &GuestMemoryMmap, q: usize, on: bool) {
        mem.write_obj(u16::from(on), GuestAddress(ring(q) + 0x1000))
            .unwrap();
    }

    #[test]
    fn a_pass_that_gives_back_transmit_and_receive_buffers_raises_one_interrupt() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let _host_port = UnixListener::bind(dir.path().join("v.sock_77")).unwrap();
        let (mut v, mem) = activated_without_thread(&uds);
        post_connect_request(&mem, 77);
        post_buffer(&mem, RX, 0, 0xa_0000, 4096, 0);
        v.queue_notify(TX as u16);
        assert_eq!(
            (used_idx(&mem, TX), used_idx(&mem, RX)),
            (1, 1),
            "the request taken and answered"
        );
        assert_eq!(raised(&v), 1, "one interrupt for both queues");
        let irqs = v.state.lock().unwrap().used_irq.counts;
        assert_eq!((irqs.raised, irqs.not_wanted), (1, 0));
        v.queue_notify(TX as u16);
        assert_eq!(raised(&v), 0, "nothing given back: no interrupt");
    }

    #[test]
    fn no_interrupt_while_the_guest_has_suppressed_them_on_every_queue_given_back() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let _host_port = UnixListener::bind(dir.path().join("v.sock_77")).unwrap();
        let (mut v, mem) = activated_without_thread(&uds);
        suppress_interrupts(&mem, TX, true);
        suppress_interrupts(&mem, RX, true);
        post_connect_request(&mem, 77);
        post_buffer(&mem, RX, 0, 0xa_0000, 4096, 0);
        v.queue_notify(TX as u16);
        assert_eq!((used_idx(&mem, TX), used_idx(&mem, RX)), (1, 1));
        assert_eq!(
            raised(&v),
            0,
            "the guest is draining both: it asked for none"
        );
        assert_eq!(v.state.lock().unwrap().used_irq.counts.not_wanted, 1);
        // The event queue still wants them: the reset raises one.
        post_buffer(&mem, EVT, 0, 0x9_0000, 4, 0);
        v.after_restore();
        assert_eq!(used_idx(&mem, EVT), 1);
        assert_eq!(raised(&v), 1);
        assert_eq!(v.state.lock().unwrap().used_irq.counts.raised, 1);
    }

    #[test]
    fn a_guest_without_an_event_buffer_is_not_held_back() {
        let dir = tempfile::tempdir().unwrap();
        let uds = dir.path().join("v.sock");
        let (mut v, _mem) = activated_without_thread(&uds);
        v.after_restore();
        assert!(v.state.lock().unwrap().reset_unacked.is_none());
    }

    #[test]
    fn reserved_cids_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let err = Vsock::new(2, &dir.path().join("v.sock")).err().unwrap();
        assert!(
            matches!(err, DeviceError::VsockCid { cid: 2, .. }),
            "{err:?}"
        );
        assert!(Vsock::new(u32::MAX as u64, &dir.path().join("v.sock")).is_err());
        assert!(Vsock::new(3, &dir.path().join("v.sock")).is_ok());
    }

    #[test]
    fn config_space_is_the_guest_cid() {
        let dir = tempfile::tempdir().unwrap();
        let v = Vsock::new(0x1234_5678, &dir.path().join("v.sock")).unwrap();
        let mut b = [0u8; 8];
        v.read_config(0, &mut b);
        assert_eq!(u64::from_le_bytes(b), 0x1234_5678);
        let mut past = [0xffu8; 4];
        v.read_config(6, &mut past);
        assert_eq!(past, [0, 0, 0, 0]);
    }
}
