//! Listening sockets: AF_VSOCK in the guest, a Unix socket for host tests.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::str::FromStr;

/// The agent's fixed vsock port.
pub const VSOCK_PORT: u32 = 52;

pub trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}
pub type Conn = Box<dyn Stream>;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    Vsock(u32),
    Unix(PathBuf),
}

impl FromStr for ListenAddr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            Ok(Self::Unix(path.into()))
        } else if let Some(port) = s.strip_prefix("vsock:") {
            port.parse()
                .map(Self::Vsock)
                .map_err(|e| format!("bad vsock port {port:?}: {e}"))
        } else {
            Err(format!("expected vsock:PORT or unix:PATH, got {s:?}"))
        }
    }
}

pub enum Listener {
    Vsock(OwnedFd),
    Unix(UnixListener),
}

impl Listener {
    pub fn bind(addr: &ListenAddr) -> io::Result<Self> {
        match addr {
            ListenAddr::Unix(path) => {
                // A stale socket from a previous run would make bind fail.
                let _ = std::fs::remove_file(path);
                Ok(Self::Unix(UnixListener::bind(path)?))
            }
            ListenAddr::Vsock(port) => bind_vsock(*port).map(Self::Vsock),
        }
    }

    pub fn accept(&self) -> io::Result<Conn> {
        match self {
            Self::Unix(l) => Ok(Box::new(l.accept()?.0)),
            Self::Vsock(fd) => loop {
                // SAFETY: accept4 on our listening socket; peer address not needed.
                let rc = unsafe {
                    libc::accept4(
                        std::os::fd::AsRawFd::as_raw_fd(fd),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC,
                    )
                };
                if rc >= 0 {
                    // SAFETY: rc is a fresh fd we own. File does plain read/write.
                    return Ok(Box::new(File::from(unsafe { OwnedFd::from_raw_fd(rc) })));
                }
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            },
        }
    }
}

fn bind_vsock(port: u32) -> io::Result<OwnedFd> {
    // SAFETY: socket/bind/listen with a fully initialised sockaddr_vm.
    unsafe {
        let fd = libc::socket(libc::AF_VSOCK, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let mut addr: libc::sockaddr_vm = std::mem::zeroed();
        addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
        addr.svm_port = port;
        addr.svm_cid = libc::VMADDR_CID_ANY;
        let raw = std::os::fd::AsRawFd::as_raw_fd(&fd);
        if libc::bind(
            raw,
            &addr as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t,
        ) < 0
            || libc::listen(raw, 128) < 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok(fd)
    }
}
