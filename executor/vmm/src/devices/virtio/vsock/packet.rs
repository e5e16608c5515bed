//! The virtio-vsock packet header: its 44-byte little-endian wire form, the op codes and flags
//! this device uses, and the headers it builds for packets going to the guest.

use super::connection::BUF_ALLOC;
use super::HOST_CID;

pub(super) const HDR_LEN: usize = 44;
/// Largest payload we accept in one guest packet.
pub(super) const MAX_PKT: u32 = 64 * 1024;

pub(super) const TYPE_STREAM: u16 = 1;
pub(super) const OP_REQUEST: u16 = 1;
pub(super) const OP_RESPONSE: u16 = 2;
pub(super) const OP_RST: u16 = 3;
pub(super) const OP_SHUTDOWN: u16 = 4;
pub(super) const OP_RW: u16 = 5;
pub(super) const OP_CREDIT_UPDATE: u16 = 6;
pub(super) const OP_CREDIT_REQUEST: u16 = 7;
pub(super) const SHUTDOWN_SEND: u32 = 2;
pub(super) const SHUTDOWN_BOTH: u32 = 3;

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

/// A host → guest header with our buffer size; callers fill in `fwd_cnt`, `len`, `flags`.
pub(super) fn host_header(guest_cid: u64, local_port: u32, peer_port: u32, op: u16) -> Header {
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
}
