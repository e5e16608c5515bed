//! Handing a lazily restored child's guest RAM to the host: the VMM worker maps anonymous RAM,
//! registers it with a userfaultfd and sends that descriptor, with where each RAM range sits
//! in its address space, over its report socket (SCM_RIGHTS). The host then supplies every
//! page the guest (or the VMM) touches first.
//!
//! Message: `M`, a u32 range count, then per range guest address, size, image offset and
//! host address (u64 LE each); the userfaultfd rides along as ancillary data.
//!
//! The other way, the host hands a worker the memory image it holds for a hot snapshot
//! (see [`crate::hot`]): `H`, with the image's memfd as ancillary data.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::Duration;

/// Ranges per message: a guest has one or two (below and above the MMIO gap).
const MAX_RANGES: usize = 8;
const TAG: u8 = b'M';
const IMAGE_TAG: u8 = b'H';
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
    send_with_fd(sock, uffd, &encode(ranges))
}

/// Host side: hand a worker the memory image of its snapshot (a sealed memfd).
pub fn send_image(sock: BorrowedFd<'_>, image: BorrowedFd<'_>) -> std::io::Result<()> {
    send_with_fd(sock, image, &[IMAGE_TAG])
}

/// Worker side: the memory image the host holds for this job's snapshot. None: the host
/// closed the socket first.
pub fn recv_image(
    sock: BorrowedFd<'_>,
    timeout: Duration,
) -> std::io::Result<Option<std::fs::File>> {
    let Some((fd, body)) = recv_with_fd(sock, timeout, 1)? else {
        return Ok(None);
    };
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    if body != [IMAGE_TAG] {
        return Err(bad("malformed image hand-off"));
    }
    let fd = fd.ok_or_else(|| bad("image hand-off without a descriptor"))?;
    Ok(Some(std::fs::File::from(fd)))
}

/// `body`, with `fd` as ancillary data, in one message.
fn send_with_fd(sock: BorrowedFd<'_>, fd: BorrowedFd<'_>, body: &[u8]) -> std::io::Result<()> {
    send_with_fds(sock, &[fd], body)
}

/// `body`, with `fds` (at most [`MAX_FDS`]) as ancillary data, in one message.
pub(crate) fn send_with_fds(
    sock: BorrowedFd<'_>,
    fds: &[BorrowedFd<'_>],
    body: &[u8],
) -> std::io::Result<()> {
    assert!(
        !fds.is_empty() && fds.len() <= MAX_FDS,
        "1 to {MAX_FDS} descriptors"
    );
    let iov = [IoSlice::new(body)];
    let bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(bytes) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: zeroed msghdr is a valid empty header; the pointers set below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: msg_control points at `space` bytes, enough for one cmsg holding `fds`.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(bytes) as usize;
        let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(data.add(i), fd.as_raw_fd());
        }
    }
    // SAFETY: a valid socket and a fully initialised msghdr.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if n as usize != body.len() {
        return Err(std::io::Error::other(
            "short write of a descriptor hand-off",
        ));
    }
    Ok(())
}

/// Host side: wait up to `timeout` for the worker's message. Ok(None): the worker closed the
/// socket first (it failed; its log says why).
pub fn recv(
    sock: BorrowedFd<'_>,
    timeout: Duration,
) -> std::io::Result<Option<(OwnedFd, Vec<MappedRange>)>> {
    let Some((fd, body)) =
        recv_with_fd(sock, timeout, 5 + MAX_RANGES * RANGE_BYTES).map_err(|e| {
            if e.kind() == std::io::ErrorKind::TimedOut {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no memory hand-off from the VMM within {timeout:?}"),
                )
            } else {
                e
            }
        })?
    else {
        return Ok(None);
    };
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let ranges = decode(&body).ok_or_else(|| bad("malformed memory hand-off"))?;
    let fd = fd.ok_or_else(|| bad("memory hand-off without a userfaultfd"))?;
    Ok(Some((fd, ranges)))
}

/// One message of at most `max` bytes and the descriptor riding along with it, if any,
/// waiting up to `timeout`. Ok(None): the peer closed the socket first.
fn recv_with_fd(
    sock: BorrowedFd<'_>,
    timeout: Duration,
    max: usize,
) -> std::io::Result<Option<(Option<OwnedFd>, Vec<u8>)>> {
    let Some((mut fds, body)) = recv_with_fds(sock, timeout, max)? else {
        return Ok(None);
    };
    if fds.len() > 1 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "more than one descriptor in a hand-off",
        ));
    }
    Ok(Some((fds.pop(), body)))
}

/// Descriptors one message may carry ([`send_with_fds`], [`recv_with_fds`]).
pub(crate) const MAX_FDS: usize = 4;

/// One message of at most `max` bytes and the descriptors riding along with it (at most
/// [`MAX_FDS`]), waiting up to `timeout`. Ok(None): the peer closed the socket first.
pub(crate) fn recv_with_fds(
    sock: BorrowedFd<'_>,
    timeout: Duration,
    max: usize,
) -> std::io::Result<Option<(Vec<OwnedFd>, Vec<u8>)>> {
    crate::ready::wait_readable(&sock, timeout)?;
    // One byte more than allowed, so an oversized message shows as one.
    let mut body = vec![0u8; max + 1];
    let mut iov = libc::iovec {
        iov_base: body.as_mut_ptr().cast(),
        iov_len: body.len(),
    };
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space =
        unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) } as usize;
    let mut control = vec![0u8; space];
    // SAFETY: as in `send_with_fds`; the buffers outlive the call.
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
    // Take ownership of every descriptor first, so a malformed message does not leak them.
    let mut fds = Vec::new();
    // SAFETY: walking the control buffer the kernel filled in; each SCM_RIGHTS entry's data
    // holds (cmsg_len - CMSG_LEN(0)) / 4 descriptors.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data_len = (*cmsg).cmsg_len - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..data_len / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if n == 0 {
        return Ok(None);
    }
    let n = n as usize;
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 || n > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "descriptor hand-off truncated or too long",
        ));
    }
    body.truncate(n);
    Ok(Some((fds, body)))
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
    fn an_image_crosses_the_socket_and_nothing_else_passes_for_one() {
        let (a, b) = pair();
        let file = tempfile::tempfile().unwrap();
        send_image(a.as_fd(), file.as_fd()).unwrap();
        let got = recv_image(b.as_fd(), Duration::from_secs(5))
            .unwrap()
            .unwrap();
        let st = |fd: RawFd| {
            // SAFETY: fstat into a zeroed stat on a valid descriptor.
            let mut s: libc::stat = unsafe { std::mem::zeroed() };
            assert_eq!(unsafe { libc::fstat(fd, &mut s) }, 0);
            (s.st_dev, s.st_ino)
        };
        assert_eq!(st(got.as_raw_fd()), st(file.as_raw_fd()));
        drop(a);
        assert!(recv_image(b.as_fd(), Duration::from_secs(1))
            .unwrap()
            .is_none());
        // A memory hand-off is not an image (a stream socket: one fresh pair per message).
        let (a, b) = pair();
        send(a.as_fd(), file.as_fd(), &[]).unwrap();
        assert!(recv_image(b.as_fd(), Duration::from_secs(5)).is_err());
        // Nor is an image a memory hand-off.
        let (a, b) = pair();
        send_image(a.as_fd(), file.as_fd()).unwrap();
        assert!(recv(b.as_fd(), Duration::from_secs(5)).is_err());
        // Bytes without a descriptor are not an image.
        let (a, b) = pair();
        std::io::Write::write_all(&mut std::fs::File::from(a), b"H").unwrap();
        assert!(recv_image(b.as_fd(), Duration::from_secs(5)).is_err());
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
