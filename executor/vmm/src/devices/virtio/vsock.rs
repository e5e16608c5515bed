//! virtio-vsock implemented in the VMM (no vhost). The host side is a Unix socket per VM:
//!
//! * host → guest: connect to the socket, send `CONNECT <port>\n`, read `OK <host port>\n`, then
//!   the stream is connected to guest port `<port>`;
//! * guest → host: a guest connection to CID 2 port `P` is connected to the Unix socket
//!   `<socket path>_P`, if something listens there.
//!
//! Streams use the virtio-vsock credit protocol both ways, so a slow reader on either side
//! stalls only its own connection. Many concurrent streams per VM are supported.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use virtio_queue::{Queue, QueueOwnedT, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::{IrqLine, VirtioDevice, INT_USED_RING};
use crate::snapshot::devices::VirtioKind;

pub const DEVICE_ID: u32 = 19;
pub const HOST_CID: u64 = 2;
const QUEUE_SIZE: u16 = 256;
const RX: usize = 0;
const TX: usize = 1;
const EVT: usize = 2;
const EVENT_TRANSPORT_RESET: u32 = 0;

const HDR_LEN: usize = 44;
const TYPE_STREAM: u16 = 1;
const OP_REQUEST: u16 = 1;
const OP_RESPONSE: u16 = 2;
const OP_RST: u16 = 3;
const OP_SHUTDOWN: u16 = 4;
const OP_RW: u16 = 5;
const OP_CREDIT_UPDATE: u16 = 6;
const OP_CREDIT_REQUEST: u16 = 7;
const SHUTDOWN_SEND: u32 = 2;
const SHUTDOWN_BOTH: u32 = 3;

/// Receive buffer we advertise per connection: guest data not yet written to the host stream.
const BUF_ALLOC: u32 = 256 * 1024;
/// Largest payload we accept in one guest packet.
const MAX_PKT: u32 = 64 * 1024;
/// Longest `CONNECT <port>\n` line we accept.
const MAX_HANDSHAKE: usize = 32;
/// First port number handed to host-initiated connections.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

const TOKEN_LISTENER: u64 = 0;

/// The 44-byte little-endian virtio-vsock packet header.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    pub fn parse(b: &[u8; HDR_LEN]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap());
        Self {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }

    pub fn to_bytes(self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }
}

#[derive(Debug, PartialEq, Eq)]
enum ConnState {
    /// Host client connected; waiting for its `CONNECT <port>` line.
    Handshake(Vec<u8>),
    /// REQUEST sent to the guest; waiting for RESPONSE or RST.
    Requested,
    Established,
}

struct Conn {
    stream: UnixStream,
    state: ConnState,
    local_port: u32,
    peer_port: u32,
    peer_buf_alloc: u32,
    peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    tx_cnt: u32,
    /// Bytes from the guest written to the host stream.
    fwd_cnt: u32,
    fwd_cnt_sent: u32,
    /// Guest data waiting for the host stream to accept it.
    to_host: VecDeque<u8>,
    /// The host stream has data we have not read yet (edge-triggered readiness).
    readable: bool,
    /// The guest said it sends no more: shut our write half once `to_host` drains.
    guest_done_sending: bool,
    /// The host stream hit EOF: the guest was told.
    host_done_sending: bool,
    /// The guest closed the connection while guest data still waits for the host stream: deliver
    /// it all, then finish the close.
    closing: Option<Closing>,
}

/// How a connection the guest closed ends once its data has reached the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Closing {
    /// The guest sent SHUTDOWN (both directions): answer with RST, as the protocol expects.
    SendRst,
    /// The guest already reset it: just forget it.
    Forget,
}

impl Conn {
    fn guest_credit(&self) -> u32 {
        self.peer_buf_alloc
            .wrapping_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }
}

struct Inner {
    guest_cid: u64,
    uds_path: PathBuf,
    epoll: Arc<Epoll>,
    mem: Option<GuestMemoryMmap>,
    queues: Vec<Queue>,
    irq: Option<IrqLine>,
    conns: HashMap<u64, Conn>,
    by_ports: HashMap<(u32, u32), u64>,
    /// Control packets (no payload) waiting for a guest receive buffer.
    ctrl: VecDeque<Header>,
    next_token: u64,
    next_local_port: u32,
    /// Set while the VM is paused for a snapshot: no guest memory is touched.
    paused: bool,
}

impl Inner {
    /// One line describing queues, interrupt and connections, for stall diagnosis.
    fn dump(&self) -> String {
        use std::fmt::Write as _;
        let mut out = format!(
            "irq_status={} paused={} ctrl_pending={}",
            self.irq.as_ref().map_or(0, |i| i.status()),
            self.paused,
            self.ctrl.len()
        );
        if let Some(h) = self.ctrl.front() {
            let _ = write!(out, " (first op {} {}->{})", h.op, h.src_port, h.dst_port);
        }
        if let Some(mem) = &self.mem {
            for (i, q) in self.queues.iter().enumerate() {
                let avail = q
                    .avail_idx(mem, std::sync::atomic::Ordering::Acquire)
                    .map(|w| w.0);
                let used = q
                    .used_idx(mem, std::sync::atomic::Ordering::Acquire)
                    .map(|w| w.0);
                let _ = write!(
                    out,
                    " q{i}[ready={} size={} next_avail={} next_used={} guest_avail={:?} guest_used={:?}]",
                    q.ready(),
                    q.size(),
                    q.next_avail(),
                    q.next_used(),
                    avail.ok(),
                    used.ok()
                );
            }
        } else {
            out += " (not activated)";
        }
        for c in self.conns.values() {
            let state = match c.state {
                ConnState::Handshake(_) => "handshake",
                ConnState::Requested => "requested",
                ConnState::Established => "established",
            };
            let _ = write!(
                out,
                " conn[{}->{} {state} readable={} credit={} to_host={} done(g={},h={})]",
                c.local_port,
                c.peer_port,
                c.readable,
                c.guest_credit(),
                c.to_host.len(),
                c.guest_done_sending,
                c.host_done_sending
            );
        }
        out
    }

    fn header(&self, local_port: u32, peer_port: u32, op: u16) -> Header {
        header(self.guest_cid, local_port, peer_port, op)
    }

    fn queue_ctrl(&mut self, token: Option<u64>, mut h: Header) {
        if let Some(c) = token.and_then(|t| self.conns.get_mut(&t)) {
            h.fwd_cnt = c.fwd_cnt;
            c.fwd_cnt_sent = c.fwd_cnt;
        }
        self.ctrl.push_back(h);
    }

    fn rst_for(&mut self, h: &Header) {
        if h.op == OP_RST {
            return;
        }
        let r = self.header(h.dst_port, h.src_port, OP_RST);
        self.ctrl.push_back(r);
    }

    fn add_conn(
        &mut self,
        stream: UnixStream,
        state: ConnState,
        local: u32,
        peer: u32,
    ) -> Option<u64> {
        let token = self.next_token;
        self.next_token += 1;
        let ev = EpollEvent::new(
            EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED,
            token,
        );
        if let Err(e) = self
            .epoll
            .ctl(ControlOperation::Add, stream.as_raw_fd(), ev)
        {
            tracing::warn!("vsock: cannot watch a stream: {e}");
            return None;
        }
        let established = state == ConnState::Established;
        self.conns.insert(
            token,
            Conn {
                stream,
                state,
                local_port: local,
                peer_port: peer,
                peer_buf_alloc: 0,
                peer_fwd_cnt: 0,
                tx_cnt: 0,
                fwd_cnt: 0,
                fwd_cnt_sent: 0,
                to_host: VecDeque::new(),
                readable: true,
                guest_done_sending: false,
                host_done_sending: false,
                closing: None,
            },
        );
        if established || local != 0 {
            self.by_ports.insert((local, peer), token);
        }
        Some(token)
    }

    fn remove_conn(&mut self, token: u64) {
        if let Some(c) = self.conns.remove(&token) {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                c.stream.as_raw_fd(),
                EpollEvent::default(),
            );
            self.by_ports.remove(&(c.local_port, c.peer_port));
        }
    }

    fn alloc_local_port(&mut self) -> u32 {
        loop {
            let p = self.next_local_port;
            self.next_local_port = self.next_local_port.wrapping_add(1).max(FIRST_LOCAL_PORT);
            if !self.by_ports.keys().any(|(l, _)| *l == p) {
                return p;
            }
        }
    }

    /// A host client connected to the VM's socket.
    fn accept(&mut self, listener: &UnixListener) {
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    if stream.set_nonblocking(true).is_ok() {
                        self.add_conn(stream, ConnState::Handshake(Vec::new()), 0, 0);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) => {
                    tracing::warn!("vsock: accept failed: {e}");
                    return;
                }
            }
        }
    }

    /// Read the `CONNECT <port>\n` line byte by byte, so data the client sends right after it
    /// stays in the socket for the established stream.
    fn handshake(&mut self, token: u64) {
        let mut done = None;
        let mut close = false;
        if let Some(c) = self.conns.get_mut(&token) {
            let ConnState::Handshake(line) = &mut c.state else {
                return;
            };
            let mut b = [0u8; 1];
            loop {
                match c.stream.read(&mut b) {
                    Ok(0) => {
                        close = true;
                        break;
                    }
                    Ok(_) if b[0] == b'\n' => {
                        done = parse_connect(line);
                        close = done.is_none();
                        break;
                    }
                    Ok(_) if line.len() < MAX_HANDSHAKE => line.push(b[0]),
                    Ok(_) => {
                        close = true;
                        break;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        c.readable = false;
                        break;
                    }
                    Err(_) => {
                        close = true;
                        break;
                    }
                }
            }
        }
        if close {
            if let Some(c) = self.conns.get_mut(&token) {
                let _ = c.stream.write_all(b"ERR bad CONNECT line\n");
            }
            self.remove_conn(token);
            return;
        }
        if let Some(peer) = done {
            let local = self.alloc_local_port();
            if let Some(c) = self.conns.get_mut(&token) {
                c.state = ConnState::Requested;
                c.local_port = local;
                c.peer_port = peer;
            }
            self.by_ports.insert((local, peer), token);
            let h = self.header(local, peer, OP_REQUEST);
            self.queue_ctrl(Some(token), h);
        }
    }

    /// Write pending guest data to the host stream; returns false if the stream is gone.
    fn flush_to_host(&mut self, token: u64) -> bool {
        let Some(c) = self.conns.get_mut(&token) else {
            return false;
        };
        while !c.to_host.is_empty() {
            let (a, _) = c.to_host.as_slices();
            match c.stream.write(a) {
                Ok(0) => return false,
                Ok(n) => {
                    c.to_host.drain(..n);
                    c.fwd_cnt = c.fwd_cnt.wrapping_add(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => return false,
            }
        }
        if c.to_host.is_empty() && c.guest_done_sending {
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
        // Tell the guest about freed buffer space before it runs dry.
        if c.fwd_cnt.wrapping_sub(c.fwd_cnt_sent) >= BUF_ALLOC / 4 {
            let mut h = header(self.guest_cid, c.local_port, c.peer_port, OP_CREDIT_UPDATE);
            h.fwd_cnt = c.fwd_cnt;
            c.fwd_cnt_sent = c.fwd_cnt;
            self.ctrl.push_back(h);
        }
        true
    }

    /// The guest closed `token`: once its pending data reached the host stream, end it `how`.
    fn close_after_drain(&mut self, token: u64, how: Closing) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        c.guest_done_sending = true;
        c.closing = Some(how);
        if !self.flush_to_host(token) {
            self.remove_conn(token);
            return;
        }
        self.finish_close_if_drained(token);
    }

    /// End a closing connection whose guest data has all been written to the host stream.
    fn finish_close_if_drained(&mut self, token: u64) {
        let Some(c) = self.conns.get(&token) else {
            return;
        };
        match c.closing {
            Some(Closing::SendRst) if c.to_host.is_empty() => self.reset_conn(token),
            Some(Closing::Forget) if c.to_host.is_empty() => self.remove_conn(token),
            _ => {}
        }
    }

    fn reset_conn(&mut self, token: u64) {
        if let Some(c) = self.conns.get(&token) {
            if c.state != ConnState::Handshake(Vec::new()) && c.local_port != 0 {
                let h = self.header(c.local_port, c.peer_port, OP_RST);
                self.ctrl.push_back(h);
            }
        }
        self.remove_conn(token);
    }

    /// One packet from the guest.
    fn on_guest_packet(&mut self, h: Header, payload: &[u8]) {
        if h.type_ != TYPE_STREAM || h.dst_cid != HOST_CID || h.src_cid != self.guest_cid {
            self.rst_for(&h);
            return;
        }
        let key = (h.dst_port, h.src_port);
        let token = self.by_ports.get(&key).copied();
        if let Some(c) = token.and_then(|t| self.conns.get_mut(&t)) {
            c.peer_buf_alloc = h.buf_alloc;
            c.peer_fwd_cnt = h.fwd_cnt;
        }
        match (h.op, token) {
            (OP_REQUEST, None) => self.guest_connect(h),
            (OP_REQUEST, Some(_)) => self.rst_for(&h),
            (OP_RESPONSE, Some(t)) => {
                let Some(c) = self.conns.get_mut(&t) else {
                    return;
                };
                if c.state != ConnState::Requested {
                    self.reset_conn(t);
                    return;
                }
                c.state = ConnState::Established;
                let line = format!("OK {}\n", c.local_port);
                c.to_host.extend(line.as_bytes());
                // The "OK" line is ours, not guest data: keep it out of the credit count.
                c.fwd_cnt = c.fwd_cnt.wrapping_sub(line.len() as u32);
                c.fwd_cnt_sent = c.fwd_cnt;
                if !self.flush_to_host(t) {
                    self.reset_conn(t);
                }
            }
            (OP_RW, Some(t)) => {
                let Some(c) = self.conns.get_mut(&t) else {
                    return;
                };
                if c.state != ConnState::Established
                    || c.to_host.len() + payload.len() > BUF_ALLOC as usize
                {
                    // Data before the handshake, or more than the credit we gave.
                    self.reset_conn(t);
                    return;
                }
                c.to_host.extend(payload);
                if !self.flush_to_host(t) {
                    self.reset_conn(t);
                }
            }
            (OP_CREDIT_UPDATE, Some(_)) => {}
            (OP_CREDIT_REQUEST, Some(t)) => {
                let (l, p) = key;
                let hdr = self.header(l, p, OP_CREDIT_UPDATE);
                self.queue_ctrl(Some(t), hdr);
            }
            (OP_SHUTDOWN, Some(t)) => {
                if h.flags & SHUTDOWN_BOTH == SHUTDOWN_BOTH {
                    // Deliver everything the guest sent before closing (a slow host reader may
                    // still be behind), then finish the close with RST.
                    self.close_after_drain(t, Closing::SendRst);
                } else if h.flags & SHUTDOWN_SEND != 0 {
                    if let Some(c) = self.conns.get_mut(&t) {
                        c.guest_done_sending = true;
                    }
                    if !self.flush_to_host(t) {
                        self.reset_conn(t);
                    }
                }
            }
            (OP_RST, Some(t)) => self.close_after_drain(t, Closing::Forget),
            (OP_RST, None) => {}
            _ => self.rst_for(&h),
        }
    }

    /// The guest connects to a host port: reach `<socket>_<port>`.
    fn guest_connect(&mut self, h: Header) {
        let path = PathBuf::from(format!("{}_{}", self.uds_path.display(), h.dst_port));
        let stream = match UnixStream::connect(&path) {
            Ok(s) if s.set_nonblocking(true).is_ok() => s,
            _ => {
                self.rst_for(&h);
                return;
            }
        };
        match self.add_conn(stream, ConnState::Established, h.dst_port, h.src_port) {
            Some(t) => {
                if let Some(c) = self.conns.get_mut(&t) {
                    c.peer_buf_alloc = h.buf_alloc;
                    c.peer_fwd_cnt = h.fwd_cnt;
                }
                let r = self.header(h.dst_port, h.src_port, OP_RESPONSE);
                self.queue_ctrl(Some(t), r);
            }
            None => self.rst_for(&h),
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
                Some((h, Some(payload))) => self.on_guest_packet(h, &payload),
                Some((h, None)) => {
                    tracing::warn!(len = h.len, "vsock: oversized or truncated guest packet");
                    self.rst_for(&h);
                }
                None => tracing::warn!("vsock: unreadable guest packet"),
            }
        }
        if used {
            self.signal();
        }
    }

    fn signal(&self) {
        if let Some(irq) = &self.irq {
            irq.trigger(INT_USED_RING);
        }
    }

    /// Fill the guest's receive queue: control packets first, then stream data within credit.
    fn process_rx(&mut self) {
        if self.paused {
            return;
        }
        let Some(mem) = self.mem.clone() else { return };
        let mut used = false;
        let mut buf = vec![0u8; MAX_PKT as usize];
        let cid = self.guest_cid;
        'chains: while let Some(chain) = self.queues[RX].pop_descriptor_chain(&mem) {
            let head = chain.head_index();
            let Ok(mut w) = chain.writer(&mem) else {
                let _ = self.queues[RX].add_used(&mem, head, 0);
                used = true;
                continue;
            };
            let room = w.available_bytes().saturating_sub(HDR_LEN);
            if let Some(h) = self.ctrl.pop_front() {
                let _ = w.write_all(&h.to_bytes());
                let _ = self.queues[RX].add_used(&mem, head, HDR_LEN as u32);
                used = true;
                continue;
            }
            // Stream data: the first connection with data and guest credit.
            let tokens: Vec<u64> = self
                .conns
                .iter()
                .filter(|(_, c)| {
                    c.state == ConnState::Established
                        && c.closing.is_none()
                        && c.readable
                        && !c.host_done_sending
                        && c.guest_credit() > 0
                })
                .map(|(t, _)| *t)
                .collect();
            for t in tokens {
                let c = self.conns.get_mut(&t).unwrap();
                let want = room.min(c.guest_credit() as usize).min(buf.len());
                if want == 0 {
                    continue;
                }
                match c.stream.read(&mut buf[..want]) {
                    Ok(0) => {
                        // Host side closed: no more data to the guest.
                        c.host_done_sending = true;
                        c.readable = false;
                        let mut h = header(cid, c.local_port, c.peer_port, OP_SHUTDOWN);
                        h.flags = SHUTDOWN_SEND;
                        h.fwd_cnt = c.fwd_cnt;
                        let _ = w.write_all(&h.to_bytes());
                        let _ = self.queues[RX].add_used(&mem, head, HDR_LEN as u32);
                        used = true;
                        continue 'chains;
                    }
                    Ok(n) => {
                        c.tx_cnt = c.tx_cnt.wrapping_add(n as u32);
                        let mut h = header(cid, c.local_port, c.peer_port, OP_RW);
                        h.len = n as u32;
                        h.fwd_cnt = c.fwd_cnt;
                        c.fwd_cnt_sent = c.fwd_cnt;
                        let _ = w.write_all(&h.to_bytes());
                        let _ = w.write_all(&buf[..n]);
                        let _ = self.queues[RX].add_used(&mem, head, (HDR_LEN + n) as u32);
                        used = true;
                        continue 'chains;
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => c.readable = false,
                    Err(_) => {
                        c.readable = false;
                        let h = header(cid, c.local_port, c.peer_port, OP_RST);
                        let peer = (c.local_port, c.peer_port);
                        let _ = w.write_all(&h.to_bytes());
                        let _ = self.queues[RX].add_used(&mem, head, HDR_LEN as u32);
                        used = true;
                        if let Some(tok) = self.by_ports.get(&peer).copied() {
                            self.remove_conn(tok);
                        }
                        continue 'chains;
                    }
                }
            }
            // Nothing to send: give the buffer back for later.
            self.queues[RX].go_to_previous_position();
            break;
        }
        if used {
            self.signal();
        }
    }

    fn on_stream_event(&mut self, token: u64, events: EventSet) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        if events.contains(EventSet::IN) || events.contains(EventSet::READ_HANG_UP) {
            c.readable = true;
        }
        if matches!(c.state, ConnState::Handshake(_)) {
            self.handshake(token);
            return;
        }
        // A client that gave up before the guest answered its request: withdraw the request
        // instead of letting the guest open (and serve) a connection nobody reads.
        if c.state == ConnState::Requested && events.contains(EventSet::HANG_UP) {
            self.reset_conn(token);
            return;
        }
        if events.contains(EventSet::OUT) {
            if !self.flush_to_host(token) {
                self.reset_conn(token);
                return;
            }
            self.finish_close_if_drained(token);
        }
        if events.contains(EventSet::ERROR) {
            self.reset_conn(token);
        }
    }
}

/// A host → guest header with our buffer size; callers fill in `fwd_cnt`, `len`, `flags`.
fn header(guest_cid: u64, local_port: u32, peer_port: u32, op: u16) -> Header {
    Header {
        src_cid: HOST_CID,
        dst_cid: guest_cid,
        src_port: local_port,
        dst_port: peer_port,
        type_: TYPE_STREAM,
        op,
        buf_alloc: BUF_ALLOC,
        ..Default::default()
    }
}

fn parse_connect(line: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    s.strip_prefix("CONNECT ")?.trim().parse().ok()
}

/// The vsock device: owns the host socket and a thread that moves host stream data.
pub struct Vsock {
    inner: Arc<Mutex<Inner>>,
    config: [u8; 8],
}

impl Vsock {
    /// Listen on `uds_path` (replaced if a stale socket is there) for guest `guest_cid`.
    pub fn new(guest_cid: u64, uds_path: &Path) -> std::io::Result<Self> {
        if guest_cid <= HOST_CID || guest_cid >= u32::MAX as u64 {
            return Err(std::io::Error::new(
                ErrorKind::InvalidInput,
                format!("guest CID {guest_cid} is reserved or out of range"),
            ));
        }
        let _ = std::fs::remove_file(uds_path);
        let listener = UnixListener::bind(uds_path)?;
        listener.set_nonblocking(true)?;
        let epoll = Arc::new(Epoll::new()?);
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
        )?;
        let inner = Arc::new(Mutex::new(Inner {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            epoll: epoll.clone(),
            mem: None,
            queues: Vec::new(),
            irq: None,
            conns: HashMap::new(),
            by_ports: HashMap::new(),
            ctrl: VecDeque::new(),
            next_token: TOKEN_LISTENER + 1,
            next_local_port: FIRST_LOCAL_PORT,
            paused: false,
        }));
        let worker = inner.clone();
        std::thread::Builder::new()
            .name("vsock".into())
            .spawn(move || event_loop(worker, epoll, listener))?;
        Ok(Self {
            inner,
            config: guest_cid.to_le_bytes(),
        })
    }
}

/// How often an idle device thread wakes to look at its interrupt line.
const IDLE_WAKE: Duration = Duration::from_secs(5);

/// How long the interrupt status may stay un-acknowledged before the interrupt is sent again.
const IRQ_RESEND_AFTER: std::time::Duration = std::time::Duration::from_millis(1000);

fn event_loop(inner: Arc<Mutex<Inner>>, epoll: Arc<Epoll>, listener: UnixListener) {
    install_dump_signal();
    let mut events = vec![EpollEvent::default(); 64];
    let mut watchdog = IrqWatchdog::default();
    let mut busy = false;
    loop {
        // Wake for the watchdog: often while something is pending, rarely when idle (a
        // hundred idle VMMs should not keep the host awake), never blocking forever since an
        // interrupt raised from a vCPU thread must still be checked.
        let timeout = if busy {
            IRQ_RESEND_AFTER / 2
        } else {
            IDLE_WAKE
        };
        let n = match epoll.wait(timeout.as_millis() as i32, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("vsock: epoll failed: {e}");
                return;
            }
        };
        let mut g = inner.lock().unwrap();
        for ev in &events[..n] {
            if ev.data() == TOKEN_LISTENER {
                g.accept(&listener);
            } else {
                g.on_stream_event(ev.data(), ev.event_set());
            }
        }
        g.process_rx();
        watchdog.check(&mut g);
        busy = watchdog.watching();
    }
}

/// Set by SIGUSR1: the device threads log their state once.
static DUMP_REQUESTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigusr1(_: libc::c_int) {
    DUMP_REQUESTED.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// `kill -USR1 <vmm pid>` makes every vsock device log its queues and connections.
fn install_dump_signal() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(libc::SIGUSR1, on_sigusr1 as *const () as libc::sighandler_t) };
    });
}

/// Recovery and diagnosis for stalls the device cannot see directly.
///
/// Linux acknowledges the interrupt status in its handler right away, so a status that stays
/// set means an interrupt never reached the guest (seen in nested virtualization). Without a
/// resend the guest never refills its receive queue and the device, having no buffers, never
/// signals again: a silent, permanent stall. Resending is harmless if the guest was just slow.
/// Likewise a connection blocked on guest credit asks for a credit update instead of waiting
/// for one forever, and work that stays pending is logged with the device state.
#[derive(Default)]
struct IrqWatchdog {
    pending_since: Option<std::time::Instant>,
    resent: u64,
    stuck_since: Option<std::time::Instant>,
    stuck_reports: u32,
    credit_asked: HashMap<u64, std::time::Instant>,
}

impl IrqWatchdog {
    /// Something is pending that the next checks must follow closely.
    fn watching(&self) -> bool {
        self.pending_since.is_some() || self.stuck_since.is_some() || !self.credit_asked.is_empty()
    }

    fn check(&mut self, g: &mut Inner) {
        if DUMP_REQUESTED.swap(false, std::sync::atomic::Ordering::SeqCst) {
            tracing::warn!("vsock state (SIGUSR1): {}", g.dump());
        }
        if g.paused || g.irq.is_none() {
            self.pending_since = None;
            return;
        }
        let now = std::time::Instant::now();
        let status = g.irq.as_ref().map_or(0, |i| i.status());
        if status == 0 {
            self.pending_since = None;
        } else {
            match self.pending_since {
                None => self.pending_since = Some(now),
                Some(t) if now.duration_since(t) >= IRQ_RESEND_AFTER => {
                    self.resent += 1;
                    if self.resent.is_power_of_two() {
                        tracing::warn!(
                            resent = self.resent,
                            "vsock: interrupt not acknowledged for {IRQ_RESEND_AFTER:?}; sending it again; {}",
                            g.dump()
                        );
                    }
                    if let Some(irq) = &g.irq {
                        irq.resend();
                    }
                    self.pending_since = Some(now);
                }
                Some(_) => {}
            }
        }
        // Connections with host data waiting on guest credit: ask for an update.
        let blocked: Vec<u64> = g
            .conns
            .iter()
            .filter(|(_, c)| {
                c.state == ConnState::Established
                    && c.closing.is_none()
                    && c.readable
                    && !c.host_done_sending
                    && c.guest_credit() == 0
            })
            .map(|(t, _)| *t)
            .collect();
        self.credit_asked.retain(|t, _| blocked.contains(t));
        let mut asked = false;
        for t in blocked {
            let due = self
                .credit_asked
                .get(&t)
                .is_none_or(|at| now.duration_since(*at) >= IRQ_RESEND_AFTER);
            if due {
                if let Some(c) = g.conns.get(&t) {
                    let h = g.header(c.local_port, c.peer_port, OP_CREDIT_REQUEST);
                    g.queue_ctrl(Some(t), h);
                    self.credit_asked.insert(t, now);
                    asked = true;
                }
            }
        }
        if asked {
            g.process_rx();
        }
        // Work that cannot get out (control packets queued, or requests unanswered): say so
        // with the state, at 3 s and then at doubling intervals.
        let requested = g
            .conns
            .values()
            .filter(|c| c.state == ConnState::Requested)
            .count();
        if g.ctrl.is_empty() && requested == 0 {
            self.stuck_since = None;
            self.stuck_reports = 0;
        } else {
            let since = *self.stuck_since.get_or_insert(now);
            let due = Duration::from_secs(3) * (1u32 << self.stuck_reports.min(8));
            if now.duration_since(since) >= due {
                self.stuck_reports += 1;
                tracing::warn!(
                    "vsock: work pending for {:.1} s; {}",
                    now.duration_since(since).as_secs_f64(),
                    g.dump()
                );
                // A guest that acknowledged but never refilled its receive ring: nudge it.
                if let Some(irq) = &g.irq {
                    irq.trigger(INT_USED_RING);
                }
            }
        }
    }
}

impl VirtioDevice for Vsock {
    fn device_type(&self) -> u32 {
        DEVICE_ID
    }

    fn features(&self) -> u64 {
        0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[QUEUE_SIZE; 3]
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        let off = offset as usize;
        for (i, b) in data.iter_mut().enumerate() {
            *b = self.config.get(off + i).copied().unwrap_or(0);
        }
    }

    fn activate(&mut self, mem: GuestMemoryMmap, queues: Vec<Queue>, irq: IrqLine, _features: u64) {
        let mut g = self.inner.lock().unwrap();
        g.mem = Some(mem);
        g.queues = queues;
        g.irq = Some(irq);
    }

    fn queue_notify(&mut self, queue: u16) {
        let mut g = self.inner.lock().unwrap();
        if queue as usize == TX {
            g.process_tx();
        }
        // New receive buffers, or answers queued by the packets just read.
        g.process_rx();
    }

    fn set_paused(&mut self, paused: bool) {
        let mut g = self.inner.lock().unwrap();
        g.paused = paused;
        if !paused {
            // Work that arrived while paused.
            g.process_tx();
            g.process_rx();
        }
    }

    fn queue_states(&self) -> Vec<QueueState> {
        self.inner
            .lock()
            .unwrap()
            .queues
            .iter()
            .map(|q| q.state())
            .collect()
    }

    fn kind(&self) -> VirtioKind {
        VirtioKind::Vsock {
            guest_cid: self.inner.lock().unwrap().guest_cid,
        }
    }

    /// Connections did not survive the snapshot: tell the guest so it drops its side (its
    /// listeners stay). Needs one of the event buffers the guest keeps posted.
    fn after_restore(&mut self) {
        let mut g = self.inner.lock().unwrap();
        let Some(mem) = g.mem.clone() else { return };
        let Some(chain) = g.queues[EVT].pop_descriptor_chain(&mem) else {
            tracing::warn!("vsock: no event buffer for the transport reset");
            return;
        };
        let head = chain.head_index();
        let ok = chain
            .writer(&mem)
            .ok()
            .and_then(|mut w| w.write_all(&EVENT_TRANSPORT_RESET.to_le_bytes()).ok())
            .is_some();
        let _ = g.queues[EVT].add_used(&mem, head, if ok { 4 } else { 0 });
        g.signal();
    }

    fn reset(&mut self) {
        let mut g = self.inner.lock().unwrap();
        let tokens: Vec<u64> = g.conns.keys().copied().collect();
        for t in tokens {
            g.remove_conn(t);
        }
        g.ctrl.clear();
        g.mem = None;
        g.queues.clear();
        g.irq = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = Header {
            src_cid: 3,
            dst_cid: 2,
            src_port: 1234,
            dst_port: 52,
            len: 9,
            type_: TYPE_STREAM,
            op: OP_RW,
            flags: 0,
            buf_alloc: BUF_ALLOC,
            fwd_cnt: 77,
        };
        assert_eq!(Header::parse(&h.to_bytes()), h);
    }

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect(b"CONNECT 52\r"), Some(52));
        assert_eq!(parse_connect(b"CONNECT x"), None);
        assert_eq!(parse_connect(b"HELLO 52"), None);
    }

    #[test]
    fn credit_wraps() {
        let s = UnixStream::pair().unwrap().0;
        let c = Conn {
            stream: s,
            state: ConnState::Established,
            local_port: 1,
            peer_port: 2,
            peer_buf_alloc: 1000,
            peer_fwd_cnt: u32::MAX - 10,
            tx_cnt: 5,
            fwd_cnt: 0,
            fwd_cnt_sent: 0,
            to_host: VecDeque::new(),
            readable: false,
            guest_done_sending: false,
            host_done_sending: false,
            closing: None,
        };
        // 16 bytes in flight across the wrap.
        assert_eq!(c.guest_credit(), 1000 - 16);
    }

    #[test]
    fn reserved_cids_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Vsock::new(2, &dir.path().join("v.sock")).is_err());
        assert!(Vsock::new(3, &dir.path().join("v.sock")).is_ok());
    }
}
