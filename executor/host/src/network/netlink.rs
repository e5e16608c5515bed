//! The few rtnetlink requests a child network needs (a veth pair, addresses, links up, a
//! default route, a link removed), made in-process: started as `ip` commands, each cost a
//! process start, which is most of a namespace's set-up (80-240 ms each in the nested lab).
//!
//! A netlink socket acts in the network namespace it was opened in, whatever thread uses it
//! later, so the host's side and a child's side each get their own [`Rtnl`].

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

// From linux/netlink.h, linux/rtnetlink.h, linux/if_link.h, linux/veth.h, linux/if_addr.h.
const NLMSG_ERROR: u16 = 2;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_EXCL: u16 = 0x200;
const NLM_F_CREATE: u16 = 0x400;
const RTM_NEWLINK: u16 = 16;
const RTM_DELLINK: u16 = 17;
const RTM_NEWADDR: u16 = 20;
const RTM_NEWROUTE: u16 = 24;
const IFLA_ADDRESS: u16 = 1;
const IFLA_IFNAME: u16 = 3;
const IFLA_LINKINFO: u16 = 18;
const IFLA_NET_NS_FD: u16 = 28;
const IFLA_INFO_KIND: u16 = 1;
const IFLA_INFO_DATA: u16 = 2;
const VETH_INFO_PEER: u16 = 1;
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const RTA_GATEWAY: u16 = 5;
const RT_TABLE_MAIN: u8 = 254;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_UNIVERSE: u8 = 0;
const RTN_UNICAST: u8 = 1;
const IFF_UP: u32 = 0x1;
/// `struct ifinfomsg`, `struct ifaddrmsg` and `struct rtmsg`.
const IFINFOMSG_LEN: usize = 16;
const NLMSGHDR_LEN: usize = 16;

/// Interface names are at most 15 bytes.
const IFNAMSIZ: usize = 16;

/// A route netlink socket in the namespace of the thread that opened it.
pub(super) struct Rtnl {
    fd: OwnedFd,
    seq: u32,
}

/// One request: its header, the family header, then attributes (nested ones patched up when
/// they close).
struct Msg {
    buf: Vec<u8>,
}

impl Msg {
    fn new(kind: u16, flags: u16, family_header: &[u8]) -> Msg {
        let mut buf = Vec::with_capacity(256);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set when sent
        buf.extend_from_slice(&kind.to_ne_bytes());
        buf.extend_from_slice(&(flags | NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // sequence, set when sent
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel's
        buf.extend_from_slice(family_header);
        Msg { buf }
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn attr(&mut self, kind: u16, payload: &[u8]) -> &mut Msg {
        let len = 4 + payload.len();
        self.buf.extend_from_slice(&(len as u16).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(payload);
        self.pad();
        self
    }

    /// A NUL-terminated string attribute.
    fn name(&mut self, kind: u16, name: &str) -> &mut Msg {
        let mut b = name.as_bytes().to_vec();
        b.push(0);
        self.attr(kind, &b)
    }

    /// Open a nested attribute; returns where its header is, for [`Msg::close`].
    fn open(&mut self, kind: u16) -> usize {
        let at = self.buf.len();
        self.buf.extend_from_slice(&0u16.to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        at
    }

    fn close(&mut self, at: usize) {
        let len = (self.buf.len() - at) as u16;
        self.buf[at..at + 2].copy_from_slice(&len.to_ne_bytes());
    }

    fn raw(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }
}

/// `struct ifinfomsg` for an interface given by name (index 0).
fn ifinfomsg(flags: u32, change: u32) -> [u8; IFINFOMSG_LEN] {
    let mut h = [0u8; IFINFOMSG_LEN];
    h[0] = libc::AF_UNSPEC as u8;
    // type (2..4) and index (4..8) stay 0.
    h[8..12].copy_from_slice(&flags.to_ne_bytes());
    h[12..16].copy_from_slice(&change.to_ne_bytes());
    h
}

fn check_name(name: &str) -> io::Result<()> {
    if name.is_empty() || name.len() >= IFNAMSIZ || name.contains(['/', '\0', ' ']) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?}"),
        ));
    }
    Ok(())
}

/// The index of interface `name` in the calling thread's namespace.
fn index_of(name: &str) -> io::Result<u32> {
    check_name(name)?;
    let c = std::ffi::CString::new(name).map_err(io::Error::other)?;
    // SAFETY: a NUL-terminated name; the call only reads it.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(i)
}

/// A netlink socket of `protocol` in the calling thread's network namespace.
pub(super) fn socket(protocol: libc::c_int) -> io::Result<OwnedFd> {
    // SAFETY: plain socket call; the descriptor is owned below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            protocol,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Rtnl {
    /// A socket in the calling thread's network namespace.
    pub fn open() -> io::Result<Rtnl> {
        Ok(Rtnl {
            fd: socket(libc::NETLINK_ROUTE)?,
            seq: 0,
        })
    }

    /// Send `msg` and wait for the kernel's answer to it: Ok on success, the errno it sent
    /// otherwise.
    fn call(&mut self, mut msg: Msg) -> io::Result<()> {
        self.seq = self.seq.wrapping_add(1);
        let len = msg.buf.len() as u32;
        msg.buf[0..4].copy_from_slice(&len.to_ne_bytes());
        msg.buf[8..12].copy_from_slice(&self.seq.to_ne_bytes());
        // SAFETY: sends the bytes of a live buffer; the kernel is the default destination of
        // an unbound netlink socket.
        let sent = unsafe {
            libc::send(
                self.fd.as_raw_fd(),
                msg.buf.as_ptr().cast(),
                msg.buf.len(),
                0,
            )
        };
        if sent < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut answer = [0u8; 8192];
        loop {
            // SAFETY: receives into a live buffer of the given length.
            let n = unsafe {
                libc::recv(
                    self.fd.as_raw_fd(),
                    answer.as_mut_ptr().cast(),
                    answer.len(),
                    0,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let mut at = 0usize;
            let n = n as usize;
            while at + NLMSGHDR_LEN <= n {
                let field = |o: usize, w: usize| &answer[at + o..at + o + w];
                let mlen = u32::from_ne_bytes(field(0, 4).try_into().unwrap()) as usize;
                let kind = u16::from_ne_bytes(field(4, 2).try_into().unwrap());
                let seq = u32::from_ne_bytes(field(8, 4).try_into().unwrap());
                if mlen < NLMSGHDR_LEN || at + mlen > n {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "a truncated netlink answer",
                    ));
                }
                if kind == NLMSG_ERROR && seq == self.seq && mlen >= NLMSGHDR_LEN + 4 {
                    let errno = i32::from_ne_bytes(field(NLMSGHDR_LEN, 4).try_into().unwrap());
                    return match errno {
                        0 => Ok(()),
                        e => Err(io::Error::from_raw_os_error(-e)),
                    };
                }
                at += mlen.next_multiple_of(4);
            }
        }
    }

    /// A veth pair: `name` here, its peer `peer` in the namespace open as `peer_ns`.
    pub fn add_veth(&mut self, name: &str, peer: &str, peer_ns: RawFd) -> io::Result<()> {
        check_name(name)?;
        check_name(peer)?;
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, &ifinfomsg(0, 0));
        m.name(IFLA_IFNAME, name);
        let info = m.open(IFLA_LINKINFO);
        m.name(IFLA_INFO_KIND, "veth");
        let data = m.open(IFLA_INFO_DATA);
        let peer_at = m.open(VETH_INFO_PEER);
        m.raw(&ifinfomsg(0, 0));
        m.name(IFLA_IFNAME, peer);
        m.attr(IFLA_NET_NS_FD, &(peer_ns as u32).to_ne_bytes());
        m.close(peer_at);
        m.close(data);
        m.close(info);
        self.call(m)
    }

    /// Bring interface `name` up (and set its MAC first, if given).
    pub fn set_up(&mut self, name: &str, mac: Option<[u8; 6]>) -> io::Result<()> {
        check_name(name)?;
        let mut m = Msg::new(RTM_NEWLINK, 0, &ifinfomsg(IFF_UP, IFF_UP));
        m.name(IFLA_IFNAME, name);
        if let Some(mac) = mac {
            m.attr(IFLA_ADDRESS, &mac);
        }
        self.call(m)
    }

    /// Add `addr/prefix` to interface `name` (looked up in the calling thread's namespace,
    /// which must be this socket's).
    pub fn add_addr(&mut self, name: &str, addr: Ipv4Addr, prefix: u8) -> io::Result<()> {
        let index = index_of(name)?;
        let mut h = [0u8; 8];
        h[0] = libc::AF_INET as u8;
        h[1] = prefix;
        h[3] = RT_SCOPE_UNIVERSE;
        h[4..8].copy_from_slice(&index.to_ne_bytes());
        let mut m = Msg::new(RTM_NEWADDR, NLM_F_CREATE | NLM_F_EXCL, &h);
        m.attr(IFA_LOCAL, &addr.octets());
        m.attr(IFA_ADDRESS, &addr.octets());
        self.call(m)
    }

    /// The main table's default route, via `gateway`.
    pub fn add_default_route(&mut self, gateway: Ipv4Addr) -> io::Result<()> {
        let h = [
            libc::AF_INET as u8,
            0, // destination prefix: the default route
            0,
            0,
            RT_TABLE_MAIN,
            RTPROT_BOOT,
            RT_SCOPE_UNIVERSE,
            RTN_UNICAST,
            0,
            0,
            0,
            0,
        ];
        let mut m = Msg::new(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, &h);
        m.attr(RTA_GATEWAY, &gateway.octets());
        self.call(m)
    }

    /// Remove interface `name`; one that does not exist is not an error.
    pub fn del_link(&mut self, name: &str) -> io::Result<()> {
        check_name(name)?;
        let mut m = Msg::new(RTM_DELLINK, 0, &ifinfomsg(0, 0));
        m.name(IFLA_IFNAME, name);
        match self.call(m) {
            Err(e) if e.raw_os_error() == Some(libc::ENODEV) => Ok(()),
            r => r,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_attributes_carry_their_whole_length() {
        let mut m = Msg::new(RTM_NEWLINK, NLM_F_CREATE, &ifinfomsg(0, 0));
        let outer = m.open(IFLA_LINKINFO);
        m.name(IFLA_INFO_KIND, "veth"); // 4 + 5 bytes, padded to 12
        m.close(outer);
        let at = NLMSGHDR_LEN + IFINFOMSG_LEN;
        assert_eq!(m.buf.len(), at + 4 + 12);
        assert_eq!(u16::from_ne_bytes([m.buf[at], m.buf[at + 1]]), 16);
        assert_eq!(&m.buf[at + 8..at + 13], b"veth\0");
        let flags = u16::from_ne_bytes([m.buf[6], m.buf[7]]);
        assert_eq!(flags, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE);
    }

    #[test]
    fn interface_names_are_checked_before_any_request() {
        for bad in ["", "a-name-too-long-x", "a/b", "a b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        check_name("tinen12").unwrap();
    }
}
