//! A tap device opened through `/dev/net/tun`: frames carry a virtio-net header both ways
//! (`IFF_VNET_HDR`), so checksum and segmentation offloads pass between guest and host kernel
//! without the VMM touching them.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::OpenOptionsExt;

/// `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
/// `_IOW('T', 203, int)`.
const TUNSETPERSIST: libc::c_ulong = 0x4004_54cb;
/// `_IOW('T', 208, unsigned int)`.
const TUNSETOFFLOAD: libc::c_ulong = 0x4004_54d0;
/// `_IOW('T', 216, int)`.
const TUNSETVNETHDRSZ: libc::c_ulong = 0x4004_54d8;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// Offloads the tap may hand us (`TUN_F_*`).
pub const TUN_F_CSUM: u32 = 0x01;
pub const TUN_F_TSO4: u32 = 0x02;
pub const TUN_F_TSO6: u32 = 0x04;

/// The virtio-net header of a VERSION_1 device (`struct virtio_net_hdr_v1`, num_buffers
/// included): the tap's default is the 10-byte legacy header.
pub const VNET_HDR_LEN: usize = 12;

/// Interface names are at most 15 bytes (IFNAMSIZ with its NUL).
const IFNAMSIZ: usize = 16;

/// `struct ifreq` as TUNSETIFF reads it: the name, then the flags (the rest of the union is
/// unused here).
#[repr(C)]
struct IfReq {
    name: [u8; IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

#[derive(Debug)]
pub struct Tap {
    file: File,
    name: String,
}

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("tap name {0:?} is empty, longer than 15 bytes or not plain ASCII")]
    Name(String),
    #[error("opening /dev/net/tun: {0}")]
    Open(#[source] io::Error),
    #[error("tap {name}: {what}: {source}")]
    Ioctl {
        name: String,
        what: &'static str,
        #[source]
        source: io::Error,
    },
}

impl Tap {
    /// Attach to the tap called `name` in the calling thread's network namespace (created
    /// if missing, though the host normally makes it ahead with its address and MAC).
    pub fn open(name: &str) -> Result<Tap, TapError> {
        if name.is_empty()
            || name.len() >= IFNAMSIZ
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        {
            return Err(TapError::Name(name.to_string()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::Open)?;
        let mut req = IfReq {
            name: [0; IFNAMSIZ],
            flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
            _pad: [0; 22],
        };
        req.name[..name.len()].copy_from_slice(name.as_bytes());
        let tap = Tap {
            file,
            name: name.to_string(),
        };
        // SAFETY: TUNSETIFF reads an ifreq, which `req` is (and outlives the call).
        tap.ioctl(
            "TUNSETIFF",
            TUNSETIFF,
            &mut req as *mut IfReq as libc::c_ulong,
        )?;
        let hdr = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int through the pointer.
        tap.ioctl(
            "TUNSETVNETHDRSZ",
            TUNSETVNETHDRSZ,
            &hdr as *const libc::c_int as libc::c_ulong,
        )?;
        Ok(tap)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Keep the device once this descriptor closes (what `ip tuntap add` makes): a host
    /// prepares a child's tap ahead, and its VMM attaches to it later.
    pub fn persist(&self) -> Result<(), TapError> {
        self.ioctl("TUNSETPERSIST", TUNSETPERSIST, 1)
    }

    /// Which offloads frames handed to us may use (`TUN_F_*`), as the guest accepted them.
    pub fn set_offload(&self, flags: u32) -> Result<(), TapError> {
        self.ioctl("TUNSETOFFLOAD", TUNSETOFFLOAD, flags as libc::c_ulong)
    }

    fn ioctl(
        &self,
        what: &'static str,
        req: libc::c_ulong,
        arg: libc::c_ulong,
    ) -> Result<(), TapError> {
        // SAFETY: the callers pass requests whose argument matches `arg` (a value or a pointer
        // to a live object of the right type).
        let rc = unsafe { libc::ioctl(self.file.as_raw_fd(), req as _, arg) };
        if rc < 0 {
            return Err(TapError::Ioctl {
                name: self.name.clone(),
                what,
                source: io::Error::last_os_error(),
            });
        }
        Ok(())
    }

    /// One frame (virtio-net header first) into `buf`; `WouldBlock` when none is waiting.
    pub fn read_frame(&self, buf: &mut [u8]) -> io::Result<usize> {
        // SAFETY: reads at most buf.len() bytes into buf.
        let n = unsafe { libc::read(self.file.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// One frame (virtio-net header first) out to the host.
    pub fn write_frame(&self, frame: &[u8]) -> io::Result<usize> {
        // SAFETY: writes frame.len() bytes from frame.
        let n = unsafe { libc::write(self.file.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }
}

impl AsFd for Tap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}
