//! Handing a lazily restored child's guest RAM to the host: the VMM worker maps anonymous RAM,
//! registers it with a userfaultfd and sends that descriptor, with where each RAM range sits
//! in its address space, over its report socket (SCM_RIGHTS). The host then supplies every
//! page the guest (or the VMM) touches first.
//!
//! Message: `M`, a u32 range count, then per range guest address, size, image offset and
//! host address (u64 LE each); the userfaultfd rides along as ancillary data.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// Ranges per message: a guest has one or two (below and above the MMIO gap).
const MAX_RANGES: usize = 8;
const TAG: u8 = b'M';
const RANGE_BYTES: usize = 32;

/// One RAM range of a child's guest, as mapped in the worker process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappedRange {
    pub guest_addr: u64,
    pub size: u64,
    /// Offset of the range in the snapshot's memory image.
    pub image_offset: u64,
    /// Where the worker mapped it.
    pub host_addr: u64,
}

impl MappedRange {
    /// The range holding worker address `addr`.
    pub fn find(ranges: &[MappedRange], addr: u64) -> Option<&MappedRange> {
        ranges
            .iter()
            .find(|r| addr >= r.host_addr && addr - r.host_addr < r.size)
    }
}

fn encode(ranges: &[MappedRange]) -> Vec<u8> {
    let mut b = Vec::with_capacity(5 + ranges.len() * RANGE_BYTES);
    b.push(TAG);
    b.extend_from_slice(&(ranges.len() as u32).to_le_bytes());
    for r in ranges {
        for v in [r.guest_addr, r.size, r.image_offset, r.host_addr] {
            b.extend_from_slice(&v.to_le_bytes());
        }
    }
    b
}

fn decode(b: &[u8]) -> Option<Vec<MappedRange>> {
    if b.first() != Some(&TAG) {
        return None;
    }
    let n = u32::from_le_bytes(b.get(1..5)?.try_into().ok()?) as usize;
    if n == 0 || n > MAX_RANGES || b.len() != 5 + n * RANGE_BYTES {
        return None;
    }
    let u = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
    let ranges: Vec<MappedRange> = (0..n)
        .map(|k| {
            let o = 5 + k * RANGE_BYTES;
            MappedRange {
                guest_addr: u(o),
                size: u(o + 8),
                image_offset: u(o + 16),
                host_addr: u(o + 24),
            }
        })
        .collect();
    // Whole pages only, and no range that wraps around.
    let sane = ranges.iter().all(|r| {
        r.size > 0
            && r.host_addr % 4096 == 0
            && r.size % 4096 == 0
            && r.image_offset % 4096 == 0
            && r.host_addr.checked_add(r.size).is_some()
            && r.image_offset.checked_add(r.size).is_some()
    });
    sane.then_some(ranges)
}

/// Worker side: send `uffd` and the ranges over `sock` (the worker's stdout socket).
pub fn send(
    sock: BorrowedFd<'_>,
    uffd: BorrowedFd<'_>,
    ranges: &[MappedRange],
) -> std::io::Result<()> {
    let body = encode(ranges);
    let iov = [IoSlice::new(&body)];
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: zeroed msghdr is a valid empty header; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: msg_control points at `space` bytes, enough for one cmsg holding one fd.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), uffd.as_raw_fd());
    }
    // SAFETY: a valid socket and a fully initialised msghdr.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if n as usize != body.len() {
        return Err(std::io::Error::other("short write of the memory hand-off"));
    }
    Ok(())
}

/// Host side: wait up to `timeout` for the worker's message. Ok(None): the worker closed the
/// socket first (it failed; its log says why).
pub fn recv(
    sock: BorrowedFd<'_>,
    timeout: Duration,
) -> std::io::Result<Option<(OwnedFd, Vec<MappedRange>)>> {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: sock.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let n = unsafe { libc::poll(&mut pfd, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no memory hand-off from the VMM within {timeout:?}"),
            ));
        }
        if n > 0 {
            break;
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
    let mut body = vec![0u8; 5 + MAX_RANGES * RANGE_BYTES];
    let mut iov = libc::iovec {
        iov_base: body.as_mut_ptr().cast(),
        iov_len: body.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: as in `send`; the buffers outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: a valid socket and msghdr; received descriptors are close-on-exec.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Take ownership of any descriptor first, so a malformed message does not leak it.
    let mut fd = None;
    // SAFETY: walking the control buffer the kernel filled in.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let raw = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>());
                fd = Some(OwnedFd::from_raw_fd(raw));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if n == 0 {
        return Ok(None);
    }
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(bad("memory hand-off truncated"));
    }
    let ranges = decode(&body[..n as usize]).ok_or_else(|| bad("malformed memory hand-off"))?;
    let fd = fd.ok_or_else(|| bad("memory hand-off without a userfaultfd"))?;
    Ok(Some((fd, ranges)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn pair() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: socketpair fills two descriptors we then own.
        assert_eq!(
            unsafe {
                libc::socketpair(
                    libc::AF_UNIX,
                    libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                    0,
                    fds.as_mut_ptr(),
                )
            },
            0
        );
        // SAFETY: fresh descriptors.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    #[test]
    fn ranges_and_descriptor_cross_the_socket() {
        let (a, b) = pair();
        let file = tempfile::tempfile().unwrap();
        let ranges = [
            MappedRange {
                guest_addr: 0,
                size: 1 << 20,
                image_offset: 0,
                host_addr: 0x7f00_0000_0000,
            },
            MappedRange {
                guest_addr: 1 << 32,
                size: 2 << 20,
                image_offset: 1 << 20,
                host_addr: 0x7f10_0000_0000,
            },
        ];
        send(a.as_fd(), file.as_fd(), &ranges).unwrap();
        let (fd, got) = recv(b.as_fd(), Duration::from_secs(5)).unwrap().unwrap();
        assert_eq!(got, ranges);
        // The received descriptor is the same open file.
        let st = |fd: RawFd| {
            // SAFETY: fstat into a zeroed stat on a valid descriptor.
            let mut s: libc::stat = unsafe { std::mem::zeroed() };
            assert_eq!(unsafe { libc::fstat(fd, &mut s) }, 0);
            (s.st_dev, s.st_ino)
        };
        assert_eq!(st(fd.as_raw_fd()), st(file.as_raw_fd()));
    }

    #[test]
    fn hostile_messages_are_refused() {
        assert_eq!(decode(b"M"), None);
        assert_eq!(decode(&[b'M', 0, 0, 0, 0]), None);
        let mut m = encode(&[MappedRange {
            guest_addr: 0,
            size: 4096,
            image_offset: 0,
            host_addr: 4096,
        }]);
        assert!(decode(&m).is_some());
        m[5 + 8] = 1; // size no longer whole pages
        assert_eq!(decode(&m), None);
        let wraps = encode(&[MappedRange {
            guest_addr: 0,
            size: 8192,
            image_offset: 0,
            host_addr: u64::MAX - 4095,
        }]);
        assert_eq!(decode(&wraps), None);
        // A closed peer is "no hand-off", not an error.
        let (a, b) = pair();
        drop(a);
        assert!(recv(b.as_fd(), Duration::from_secs(1)).unwrap().is_none());
    }
}
