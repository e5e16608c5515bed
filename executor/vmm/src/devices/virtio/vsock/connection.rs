//! One stream between a host Unix-socket client and the guest: its state machine (handshake,
//! requested, established, closing) and the virtio-vsock credit accounting in both directions.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;

use super::packet::{
    host_header, Header, OP_CREDIT_UPDATE, OP_RST, OP_RW, OP_SHUTDOWN, SHUTDOWN_SEND,
};

/// Receive buffer we advertise per connection: guest data not yet written to the host stream.
pub(super) const BUF_ALLOC: u32 = 256 * 1024;

#[derive(Debug, PartialEq, Eq)]
pub(super) enum ConnState {
    /// Host client connected; waiting for its `CONNECT <port>` line.
    Handshake(Vec<u8>),
    /// REQUEST sent to the guest; waiting for RESPONSE or RST.
    Requested,
    Established,
}

/// How a connection the guest closed ends once its data has reached the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Closing {
    /// The guest sent SHUTDOWN (both directions): answer with RST, as the protocol expects.
    SendRst,
    /// The guest already reset it: just forget it.
    Forget,
}

pub(super) struct Conn {
    pub(super) stream: UnixStream,
    pub(super) state: ConnState,
    pub(super) local_port: u32,
    pub(super) peer_port: u32,
    pub(super) peer_buf_alloc: u32,
    pub(super) peer_fwd_cnt: u32,
    /// Bytes sent to the guest.
    pub(super) tx_cnt: u32,
    /// Bytes from the guest written to the host stream.
    pub(super) fwd_cnt: u32,
    pub(super) fwd_cnt_sent: u32,
    /// Guest data waiting for the host stream to accept it.
    pub(super) to_host: VecDeque<u8>,
    /// The host stream has data we have not read yet (edge-triggered readiness).
    pub(super) readable: bool,
    /// The guest said it sends no more: shut our write half once `to_host` drains.
    pub(super) guest_done_sending: bool,
    /// The host stream hit EOF: the guest was told.
    pub(super) host_done_sending: bool,
    /// The guest closed the connection while guest data still waits for the host stream: deliver
    /// it all, then finish the close.
    pub(super) closing: Option<Closing>,
}

/// What reading a host stream produced for the guest.
pub(super) enum FromHost {
    /// Send this header with that many payload bytes from the read buffer.
    Packet(Header, usize),
    /// The stream failed: send this RST and forget the connection.
    Broken(Header),
    /// Nothing to read now.
    Idle,
}

impl Conn {
    /// A new connection; the host stream is assumed readable until it says otherwise.
    pub(super) fn new(
        stream: UnixStream,
        state: ConnState,
        local_port: u32,
        peer_port: u32,
    ) -> Self {
        Self {
            stream,
            state,
            local_port,
            peer_port,
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
        }
    }

    /// Bytes the guest can still take on this connection (counters wrap, as the spec says).
    pub(super) fn guest_credit(&self) -> u32 {
        self.peer_buf_alloc
            .wrapping_sub(self.tx_cnt.wrapping_sub(self.peer_fwd_cnt))
    }

    /// Whether host data may be waiting to go to the guest, credit permitting.
    pub(super) fn has_host_data(&self) -> bool {
        self.state == ConnState::Established
            && self.closing.is_none()
            && self.readable
            && !self.host_done_sending
    }

    /// Write pending guest data to the host stream; returns false if the stream is gone.
    pub(super) fn flush_to_host(&mut self) -> bool {
        while !self.to_host.is_empty() {
            let (a, _) = self.to_host.as_slices();
            match self.stream.write(a) {
                Ok(0) => return false,
                Ok(n) => {
                    self.to_host.drain(..n);
                    self.fwd_cnt = self.fwd_cnt.wrapping_add(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => return false,
            }
        }
        if self.to_host.is_empty() && self.guest_done_sending {
            let _ = self.stream.shutdown(std::net::Shutdown::Write);
        }
        true
    }

    /// A credit update once a quarter of our buffer was freed, so the guest hears about the
    /// space before it runs dry.
    pub(super) fn credit_update_due(&mut self, guest_cid: u64) -> Option<Header> {
        if self.fwd_cnt.wrapping_sub(self.fwd_cnt_sent) < BUF_ALLOC / 4 {
            return None;
        }
        let mut h = host_header(guest_cid, self.local_port, self.peer_port, OP_CREDIT_UPDATE);
        h.fwd_cnt = self.fwd_cnt;
        self.fwd_cnt_sent = self.fwd_cnt;
        Some(h)
    }

    /// Read host data into `buf` (sized by the caller to the guest's credit and buffer).
    pub(super) fn read_for_guest(&mut self, guest_cid: u64, buf: &mut [u8]) -> FromHost {
        match self.stream.read(buf) {
            Ok(0) => {
                // Host side closed: no more data to the guest.
                self.host_done_sending = true;
                self.readable = false;
                let mut h = host_header(guest_cid, self.local_port, self.peer_port, OP_SHUTDOWN);
                h.flags = SHUTDOWN_SEND;
                h.fwd_cnt = self.fwd_cnt;
                FromHost::Packet(h, 0)
            }
            Ok(n) => {
                self.tx_cnt = self.tx_cnt.wrapping_add(n as u32);
                let mut h = host_header(guest_cid, self.local_port, self.peer_port, OP_RW);
                h.len = n as u32;
                h.fwd_cnt = self.fwd_cnt;
                self.fwd_cnt_sent = self.fwd_cnt;
                FromHost::Packet(h, n)
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                self.readable = false;
                FromHost::Idle
            }
            Err(_) => {
                self.readable = false;
                FromHost::Broken(host_header(
                    guest_cid,
                    self.local_port,
                    self.peer_port,
                    OP_RST,
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credit_wraps() {
        let s = UnixStream::pair().unwrap().0;
        let mut c = Conn::new(s, ConnState::Established, 1, 2);
        c.peer_buf_alloc = 1000;
        c.peer_fwd_cnt = u32::MAX - 10;
        c.tx_cnt = 5;
        // 16 bytes in flight across the wrap.
        assert_eq!(c.guest_credit(), 1000 - 16);
    }

    #[test]
    fn credit_update_after_a_quarter_of_the_buffer() {
        let s = UnixStream::pair().unwrap().0;
        let mut c = Conn::new(s, ConnState::Established, 1, 2);
        c.fwd_cnt = BUF_ALLOC / 4 - 1;
        assert!(c.credit_update_due(3).is_none(), "not yet a quarter");
        c.fwd_cnt += 1;
        let h = c.credit_update_due(3).unwrap();
        assert_eq!(
            (h.op, h.fwd_cnt, h.dst_cid),
            (OP_CREDIT_UPDATE, BUF_ALLOC / 4, 3)
        );
        assert!(c.credit_update_due(3).is_none(), "sent once");
    }

    #[test]
    fn flush_counts_bytes_and_passes_on_the_guest_shutdown() {
        let (s, mut peer) = UnixStream::pair().unwrap();
        s.set_nonblocking(true).unwrap();
        let mut c = Conn::new(s, ConnState::Established, 1, 2);
        c.to_host.extend(b"hello");
        c.guest_done_sending = true;
        assert!(c.flush_to_host());
        assert_eq!(c.fwd_cnt, 5);
        let mut got = String::new();
        peer.read_to_string(&mut got).unwrap();
        assert_eq!(got, "hello", "write half shut after the data");
    }
}
