//! The host side of the device: the VM's listening Unix socket and its `CONNECT <port>`
//! handshake, the sockets the guest connects to (`<socket>_<port>`), and the connection table
//! that routes guest packets to host streams and host data back. Control packets for the guest
//! wait here until the device has a receive buffer for them.

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::connection::{Closing, Conn, ConnState, FromHost, BUF_ALLOC};
use super::packet::{
    host_header, Header, OP_CREDIT_REQUEST, OP_CREDIT_UPDATE, OP_REQUEST, OP_RESPONSE, OP_RST,
    OP_RW, OP_SHUTDOWN, SHUTDOWN_BOTH, SHUTDOWN_SEND, TYPE_STREAM,
};
use super::HOST_CID;

/// Epoll token of the listening socket; connections get the tokens after it.
pub(super) const TOKEN_LISTENER: u64 = 0;
/// Longest `CONNECT <port>\n` line we accept.
const MAX_HANDSHAKE: usize = 32;
/// First port number handed to host-initiated connections.
const FIRST_LOCAL_PORT: u32 = 1 << 30;

/// Where this VMM's host-initiated connections start numbering: a random point of the upper
/// 2^30 ports. A restored guest can still hold a socket of its parent's last connection (the
/// agent closed it just before the snapshot; the guest drops it after its close timeout,
/// seconds later), and every VMM counting from the same first port would hand a child's early
/// connection that very port pair, which the guest then refuses with a reset.
fn first_local_port() -> u32 {
    let mut r = [0u8; 4];
    // SAFETY: getrandom writes at most `r.len()` bytes into `r`.
    let n = unsafe { libc::getrandom(r.as_mut_ptr().cast(), r.len(), 0) };
    if n != r.len() as isize {
        return FIRST_LOCAL_PORT;
    }
    FIRST_LOCAL_PORT | (u32::from_ne_bytes(r) & (FIRST_LOCAL_PORT - 1))
}

pub(super) struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    listener: UnixListener,
    epoll: Arc<Epoll>,
    pub(super) conns: HashMap<u64, Conn>,
    by_ports: HashMap<(u32, u32), u64>,
    /// Control packets (no payload) waiting for a guest receive buffer.
    pub(super) ctrl: VecDeque<Header>,
    next_token: u64,
    next_local_port: u32,
}

impl Muxer {
    /// Listen on `uds_path` (replaced if a stale socket is there), watched by a new epoll set.
    pub(super) fn bind(guest_cid: u64, uds_path: &Path) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(uds_path);
        let listener = UnixListener::bind(uds_path)?;
        listener.set_nonblocking(true)?;
        let epoll = Arc::new(Epoll::new()?);
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, TOKEN_LISTENER),
        )?;
        Ok(Self {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            listener,
            epoll,
            conns: HashMap::new(),
            by_ports: HashMap::new(),
            ctrl: VecDeque::new(),
            next_token: TOKEN_LISTENER + 1,
            next_local_port: first_local_port(),
        })
    }

    /// The epoll set of the listener and every host stream, for the device thread to wait on.
    pub(super) fn epoll(&self) -> Arc<Epoll> {
        self.epoll.clone()
    }

    fn header(&self, local_port: u32, peer_port: u32, op: u16) -> Header {
        host_header(self.guest_cid, local_port, peer_port, op)
    }

    fn queue_ctrl(&mut self, token: Option<u64>, mut h: Header) {
        if let Some(c) = token.and_then(|t| self.conns.get_mut(&t)) {
            h.fwd_cnt = c.fwd_cnt;
            c.fwd_cnt_sent = c.fwd_cnt;
        }
        self.ctrl.push_back(h);
    }

    /// Answer a packet we cannot take with RST (never answering an RST).
    pub(super) fn rst_for(&mut self, h: &Header) {
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
        self.conns
            .insert(token, Conn::new(stream, state, local, peer));
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

    /// Forget every connection and queued packet (the driver reset the device).
    pub(super) fn reset(&mut self) {
        let tokens: Vec<u64> = self.conns.keys().copied().collect();
        for t in tokens {
            self.remove_conn(t);
        }
        self.ctrl.clear();
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

    /// Host clients connected to the VM's socket.
    pub(super) fn accept(&mut self) {
        loop {
            match self.listener.accept() {
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

    /// Read the `CONNECT <port>\n` line, and nothing after it: data the client sends right
    /// after the line stays in the socket for the established stream. What is there is peeked
    /// at and only the line taken (two calls, not one per byte).
    fn handshake(&mut self, token: u64) {
        let mut done = None;
        let mut close = false;
        if let Some(c) = self.conns.get_mut(&token) {
            let ConnState::Handshake(line) = &mut c.state else {
                return;
            };
            let mut buf = [0u8; MAX_HANDSHAKE + 1];
            loop {
                let room = MAX_HANDSHAKE + 1 - line.len();
                match peek(&c.stream, &mut buf[..room]) {
                    Ok(0) => {
                        close = true;
                        break;
                    }
                    Ok(n) => {
                        let end = buf[..n].iter().position(|b| *b == b'\n');
                        let take = end.map_or(n, |i| i + 1);
                        if c.stream.read_exact(&mut buf[..take]).is_err() {
                            close = true;
                            break;
                        }
                        if let Some(i) = end {
                            line.extend_from_slice(&buf[..i]);
                            done = parse_connect(line);
                            close = done.is_none();
                            break;
                        }
                        line.extend_from_slice(&buf[..n]);
                        if line.len() > MAX_HANDSHAKE {
                            close = true;
                            break;
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        c.readable = false;
                        break;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
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

    /// Write pending guest data to the host stream, queueing a credit update when due;
    /// returns false if the stream is gone.
    fn flush_to_host(&mut self, token: u64) -> bool {
        let Some(c) = self.conns.get_mut(&token) else {
            return false;
        };
        if !c.flush_to_host() {
            return false;
        }
        if let Some(h) = c.credit_update_due(self.guest_cid) {
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
        let Some(c) = self.conns.get(&token) else {
            return;
        };
        let (local, peer) = (c.local_port, c.peer_port);
        let known_to_guest = match c.state {
            ConnState::Handshake(_) => false,
            // A request still waiting for a receive buffer is taken back, so the guest never
            // hears of the connection rather than accepting it only to be reset: this is how
            // a caller that gave up is withdrawn, and the guest may be slow already.
            ConnState::Requested => !self.withdraw_request(local, peer),
            ConnState::Established => true,
        };
        if known_to_guest && local != 0 {
            let h = self.header(local, peer, OP_RST);
            self.ctrl.push_back(h);
        }
        self.remove_conn(token);
    }

    /// Take back the REQUEST for `local` -> `peer` if the guest was not given it yet; whether
    /// it was still queued.
    fn withdraw_request(&mut self, local: u32, peer: u32) -> bool {
        let queued = self.ctrl.len();
        self.ctrl
            .retain(|h| !(h.op == OP_REQUEST && h.src_port == local && h.dst_port == peer));
        self.ctrl.len() < queued
    }

    /// One packet from the guest.
    pub(super) fn on_guest_packet(&mut self, h: Header, payload: &[u8]) {
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

    /// The next packet for a guest receive buffer with `room` payload bytes: a queued control
    /// packet first, else stream data within the guest's credit (its payload read into `buf`).
    /// Returns the header and the payload length.
    pub(super) fn next_for_guest(
        &mut self,
        room: usize,
        buf: &mut [u8],
    ) -> Option<(Header, usize)> {
        if let Some(h) = self.ctrl.pop_front() {
            return Some((h, 0));
        }
        let tokens: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.has_host_data() && c.guest_credit() > 0)
            .map(|(t, _)| *t)
            .collect();
        for t in tokens {
            let Some(c) = self.conns.get_mut(&t) else {
                continue;
            };
            let want = room.min(c.guest_credit() as usize).min(buf.len());
            if want == 0 {
                continue;
            }
            match c.read_for_guest(self.guest_cid, &mut buf[..want]) {
                FromHost::Packet(h, n) => return Some((h, n)),
                FromHost::Broken(h) => {
                    self.remove_conn(t);
                    return Some((h, 0));
                }
                FromHost::Idle => {}
            }
        }
        None
    }

    /// Readiness of a host stream.
    pub(super) fn on_stream_event(&mut self, token: u64, events: EventSet) {
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

    /// Connections whose host data waits only for guest credit.
    pub(super) fn credit_starved(&self) -> Vec<u64> {
        self.conns
            .iter()
            .filter(|(_, c)| c.has_host_data() && c.guest_credit() == 0)
            .map(|(t, _)| *t)
            .collect()
    }

    /// Ask the guest for a credit update on `token`; false if the connection is gone.
    pub(super) fn request_credit(&mut self, token: u64) -> bool {
        let Some(c) = self.conns.get(&token) else {
            return false;
        };
        let h = self.header(c.local_port, c.peer_port, OP_CREDIT_REQUEST);
        self.queue_ctrl(Some(token), h);
        true
    }

    /// Work only the guest can move on: queued control packets or unanswered requests.
    pub(super) fn awaiting_guest(&self) -> bool {
        !self.ctrl.is_empty() || self.conns.values().any(|c| c.state == ConnState::Requested)
    }
}

/// What `stream` holds, without taking it (`MSG_PEEK`): at most `buf.len()` bytes.
fn peek(stream: &UnixStream, buf: &mut [u8]) -> std::io::Result<usize> {
    // SAFETY: recv writes at most `buf.len()` bytes into `buf`, which outlives the call.
    let n = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK,
        )
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

fn parse_connect(line: &[u8]) -> Option<u32> {
    let s = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
    s.strip_prefix("CONNECT ")?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connect_lines() {
        assert_eq!(parse_connect(b"CONNECT 52"), Some(52));
        assert_eq!(parse_connect(b"CONNECT 52\r"), Some(52));
        assert_eq!(parse_connect(b"CONNECT x"), None);
        assert_eq!(parse_connect(b"HELLO 52"), None);
    }

    /// A client that hangs up before its request reached the guest is withdrawn without a
    /// word to the guest; one that hangs up after is reset.
    #[test]
    fn a_client_that_gives_up_first_is_never_offered_to_the_guest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let mut m = Muxer::bind(3, &path).unwrap();
        let connect = |m: &mut Muxer| {
            let mut client = UnixStream::connect(&path).unwrap();
            client.write_all(b"CONNECT 52\n").unwrap();
            m.accept();
            let token = *m.conns.keys().max().unwrap();
            m.on_stream_event(token, EventSet::IN);
            (client, token)
        };
        let (client, token) = connect(&mut m);
        drop(client);
        m.on_stream_event(token, EventSet::IN | EventSet::HANG_UP);
        assert!(m.conns.is_empty(), "withdrawn");
        assert!(
            m.ctrl.is_empty(),
            "its request was taken back, and no reset sent"
        );
        assert!(m.next_for_guest(4096, &mut [0u8; 16]).is_none());

        let (client, token) = connect(&mut m);
        let (req, _) = m.next_for_guest(4096, &mut [0u8; 16]).unwrap();
        assert_eq!(req.op, OP_REQUEST);
        drop(client);
        m.on_stream_event(token, EventSet::IN | EventSet::HANG_UP);
        let (rst, _) = m.next_for_guest(4096, &mut [0u8; 16]).unwrap();
        assert_eq!(
            (rst.op, rst.src_port, rst.dst_port),
            (OP_RST, req.src_port, 52),
            "the guest was offered it: it is told"
        );
    }

    /// A host client's CONNECT becomes a REQUEST to the guest; the guest's RESPONSE sends the
    /// client its `OK <port>` line.
    #[test]
    fn host_connect_handshake() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let mut m = Muxer::bind(3, &path).unwrap();
        let mut client = UnixStream::connect(&path).unwrap();
        client.write_all(b"CONNECT 52\n").unwrap();
        m.accept();
        let token = *m.conns.keys().next().unwrap();
        m.on_stream_event(token, EventSet::IN);
        let (req, n) = m.next_for_guest(4096, &mut [0u8; 16]).unwrap();
        assert_eq!(
            (req.op, req.dst_port, req.dst_cid, n),
            (OP_REQUEST, 52, 3, 0)
        );
        assert!(m.awaiting_guest(), "the request is unanswered");

        let resp = accepting(&req);
        m.on_guest_packet(resp, &[]);
        assert!(!m.awaiting_guest());
        let mut line = [0u8; 14];
        client.read_exact(&mut line).unwrap();
        assert_eq!(line, *format!("OK {}\n", req.src_port).as_bytes());
    }

    /// The guest's RESPONSE to `req` (a REQUEST to its port 52), with 4 KiB of credit.
    fn accepting(req: &Header) -> Header {
        Header {
            src_cid: 3,
            dst_cid: HOST_CID,
            src_port: 52,
            dst_port: req.src_port,
            type_: TYPE_STREAM,
            op: OP_RESPONSE,
            buf_alloc: 4096,
            ..Default::default()
        }
    }

    /// A muxer with one host client accepted (its directory, which must outlive it, first).
    fn one_client() -> (tempfile::TempDir, Muxer, UnixStream, u64) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v.sock");
        let mut m = Muxer::bind(3, &path).unwrap();
        let client = UnixStream::connect(&path).unwrap();
        m.accept();
        let token = *m.conns.keys().next().unwrap();
        (dir, m, client, token)
    }

    /// A CONNECT line that arrives in pieces is read whole; what the client sent after it
    /// stays in the socket, for the guest.
    #[test]
    fn a_connect_line_in_pieces_is_read_whole_and_what_follows_it_stays() {
        let (_dir, mut m, mut client, token) = one_client();
        client.write_all(b"CONN").unwrap();
        m.on_stream_event(token, EventSet::IN);
        assert!(
            m.next_for_guest(4096, &mut [0u8; 16]).is_none(),
            "no request before the line ends"
        );
        client.write_all(b"ECT 52\nhello").unwrap();
        m.on_stream_event(token, EventSet::IN);
        let (req, _) = m.next_for_guest(4096, &mut [0u8; 16]).unwrap();
        assert_eq!((req.op, req.dst_port), (OP_REQUEST, 52));
        let mut rest = [0u8; 16];
        let n = peek(&m.conns[&token].stream, &mut rest).unwrap();
        assert_eq!(&rest[..n], b"hello");
    }

    /// A request the client sent in the same write as its CONNECT line (before any `OK`) goes
    /// to the guest as soon as the guest accepts, with no further readiness event: the stream
    /// is watched edge-triggered, and its only event came with the line.
    #[test]
    fn data_sent_with_the_connect_line_follows_the_guests_answer_at_once() {
        let (_dir, mut m, mut client, token) = one_client();
        client.write_all(b"CONNECT 52\nhello").unwrap();
        m.on_stream_event(token, EventSet::IN);
        let mut buf = [0u8; 16];
        let (req, _) = m.next_for_guest(4096, &mut buf).unwrap();
        assert_eq!((req.op, req.dst_port), (OP_REQUEST, 52));
        assert!(
            m.next_for_guest(4096, &mut buf).is_none(),
            "nothing for the guest before it accepts"
        );
        let resp = accepting(&req);
        m.on_guest_packet(resp, &[]);
        let (data, n) = m.next_for_guest(4096, &mut buf).unwrap();
        assert_eq!(
            (data.op, data.src_port, data.dst_port),
            (OP_RW, req.src_port, 52)
        );
        assert_eq!(&buf[..n], b"hello");
        let mut line = [0u8; 14];
        client.read_exact(&mut line).unwrap();
        assert_eq!(line, *format!("OK {}\n", req.src_port).as_bytes());
    }

    /// A line longer than any CONNECT is refused, in one piece or several.
    #[test]
    fn an_overlong_connect_line_is_refused() {
        for pieces in [1, 3] {
            let (_dir, mut m, mut client, token) = one_client();
            let long = [b'C'; MAX_HANDSHAKE + 8];
            for chunk in long.chunks(long.len().div_ceil(pieces)) {
                client.write_all(chunk).unwrap();
                m.on_stream_event(token, EventSet::IN);
            }
            assert!(m.conns.is_empty(), "closed ({pieces} pieces)");
            // Read only the line: the rest is a reset, the bytes it never read being dropped.
            let mut reply = [0u8; 21];
            client.read_exact(&mut reply).unwrap();
            assert_eq!(&reply, b"ERR bad CONNECT line\n");
        }
    }
}
