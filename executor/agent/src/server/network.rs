//! The guest's network interface, configured at boot from the kernel command line the host
//! chose: `tine.ip=ADDR/PREFIX`, optionally `tine.gw=ADDR` and `tine.dns=ADDR[,ADDR...]`.
//! Without `tine.ip` only the loopback is brought up. The guest kernel has no IP
//! autoconfiguration and the image no DHCP client, and none is wanted: clones keep the
//! address their parent booted with (the host tells them apart outside the guest).

use std::ffi::CString;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    pub addr: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Option<Ipv4Addr>,
    pub dns: Vec<Ipv4Addr>,
}

/// The network settings in a kernel command line; Ok(None) when it has none.
pub fn parse_cmdline(cmdline: &str) -> Result<Option<NetConfig>, String> {
    let mut ip = None;
    let mut gateway = None;
    let mut dns = Vec::new();
    for word in cmdline.split_whitespace() {
        let Some((key, value)) = word.split_once('=') else {
            continue;
        };
        let addr = |s: &str| {
            s.parse::<Ipv4Addr>()
                .map_err(|_| format!("{key}: {s:?} is not an IPv4 address"))
        };
        match key {
            "tine.ip" => {
                let (a, p) = value
                    .split_once('/')
                    .ok_or_else(|| format!("tine.ip: {value:?} is not ADDR/PREFIX"))?;
                let prefix = p
                    .parse::<u8>()
                    .ok()
                    .filter(|p| (1..=32).contains(p))
                    .ok_or_else(|| format!("tine.ip: prefix {p:?} is not 1..=32"))?;
                ip = Some((addr(a)?, prefix));
            }
            "tine.gw" => gateway = Some(addr(value)?),
            "tine.dns" => {
                for a in value.split(',').filter(|a| !a.is_empty()) {
                    dns.push(addr(a)?);
                }
            }
            _ => {}
        }
    }
    Ok(ip.map(|(addr, prefix)| NetConfig {
        addr,
        prefix,
        gateway,
        dns,
    }))
}

const SIOCGIFFLAGS: libc::c_ulong = 0x8913;
const SIOCSIFFLAGS: libc::c_ulong = 0x8914;
const SIOCSIFADDR: libc::c_ulong = 0x8916;
const SIOCSIFNETMASK: libc::c_ulong = 0x891c;
const SIOCADDRT: libc::c_ulong = 0x890b;

/// `struct ifreq` with the union read as a sockaddr or as flags.
#[repr(C)]
struct IfReq {
    name: [u8; 16],
    data: [u8; 24],
}

impl IfReq {
    fn new(iface: &str) -> io::Result<IfReq> {
        if iface.is_empty() || iface.len() > 15 {
            return Err(io::Error::other(format!("bad interface name {iface:?}")));
        }
        let mut r = IfReq {
            name: [0; 16],
            data: [0; 24],
        };
        r.name[..iface.len()].copy_from_slice(iface.as_bytes());
        Ok(r)
    }

    fn set_addr(&mut self, a: Ipv4Addr) {
        self.data = [0; 24];
        self.data[..16].copy_from_slice(&sockaddr(a));
    }
}

/// A `struct sockaddr_in` (16 bytes) for `a`.
fn sockaddr(a: Ipv4Addr) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
    s[4..8].copy_from_slice(&a.octets());
    s
}

fn socket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket(2); the descriptor is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ioctl<T>(sock: &OwnedFd, req: libc::c_ulong, arg: &mut T, what: &str) -> io::Result<()> {
    // SAFETY: each caller passes the structure its request reads or fills.
    let rc = unsafe { libc::ioctl(sock.as_raw_fd(), req as _, arg as *mut T) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(e.kind(), format!("{what}: {e}")));
    }
    Ok(())
}

fn link_up(sock: &OwnedFd, iface: &str) -> io::Result<()> {
    let mut r = IfReq::new(iface)?;
    ioctl(
        sock,
        SIOCGIFFLAGS,
        &mut r,
        &format!("reading {iface}'s flags"),
    )?;
    let flags = i16::from_ne_bytes([r.data[0], r.data[1]]) | libc::IFF_UP as i16;
    r.data[..2].copy_from_slice(&flags.to_ne_bytes());
    ioctl(sock, SIOCSIFFLAGS, &mut r, &format!("bringing {iface} up"))
}

/// The first interface other than the loopback (virtio-net's `eth0`).
fn first_interface() -> io::Result<Option<String>> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/net")?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "lo")
        .collect();
    names.sort();
    Ok(names.into_iter().next())
}

/// Bring the loopback up, then configure `cfg` (if any) on the first other interface.
/// Returns the interface configured.
pub fn configure(cfg: Option<&NetConfig>) -> io::Result<Option<String>> {
    let sock = socket()?;
    link_up(&sock, "lo")?;
    let Some(cfg) = cfg else { return Ok(None) };
    let iface = first_interface()?.ok_or_else(|| {
        io::Error::other(
            "tine.ip is set but the guest has no network interface (is virtio_net loaded?)",
        )
    })?;
    let mut r = IfReq::new(&iface)?;
    r.set_addr(cfg.addr);
    ioctl(
        &sock,
        SIOCSIFADDR,
        &mut r,
        &format!("setting {iface}'s address"),
    )?;
    let mask = Ipv4Addr::from(u32::MAX.checked_shl(32 - cfg.prefix as u32).unwrap_or(0));
    r.set_addr(mask);
    ioctl(
        &sock,
        SIOCSIFNETMASK,
        &mut r,
        &format!("setting {iface}'s netmask"),
    )?;
    link_up(&sock, &iface)?;
    if let Some(gw) = cfg.gateway {
        let dev = CString::new(iface.clone()).map_err(io::Error::other)?;
        // SAFETY: all-zero is a valid rtentry (null pointers, zero addresses).
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        let set = |s: &mut libc::sockaddr, a: Ipv4Addr| {
            // SAFETY: sockaddr and sockaddr_in are both 16 bytes.
            *s = unsafe { std::mem::transmute::<[u8; 16], libc::sockaddr>(sockaddr(a)) };
        };
        set(&mut rt.rt_dst, Ipv4Addr::UNSPECIFIED);
        set(&mut rt.rt_genmask, Ipv4Addr::UNSPECIFIED);
        set(&mut rt.rt_gateway, gw);
        rt.rt_flags = (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort;
        rt.rt_dev = dev.as_ptr() as *mut libc::c_char;
        ioctl(
            &sock,
            SIOCADDRT,
            &mut rt,
            &format!("adding the default route via {gw}"),
        )?;
    }
    if !cfg.dns.is_empty() {
        let text: String = cfg
            .dns
            .iter()
            .map(|a| format!("nameserver {a}\n"))
            .collect();
        std::fs::create_dir_all("/etc")?;
        std::fs::write("/etc/resolv.conf", text)?;
    }
    Ok(Some(iface))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_names_the_address_gateway_and_resolvers() {
        let c = parse_cmdline(
            "console=ttyS0 tine.ip=10.254.0.2/30 tine.gw=10.254.0.1 tine.dns=1.1.1.1,9.9.9.9 quiet",
        )
        .unwrap()
        .unwrap();
        assert_eq!(c.addr, Ipv4Addr::new(10, 254, 0, 2));
        assert_eq!(c.prefix, 30);
        assert_eq!(c.gateway, Some(Ipv4Addr::new(10, 254, 0, 1)));
        assert_eq!(c.dns.len(), 2);
        assert_eq!(parse_cmdline("console=ttyS0 panic=-1").unwrap(), None);
    }

    #[test]
    fn malformed_settings_are_refused() {
        for bad in [
            "tine.ip=10.254.0.2",
            "tine.ip=10.254.0.2/33",
            "tine.ip=10.254.0.2/0",
            "tine.ip=host/24",
            "tine.ip=10.0.0.2/24 tine.gw=x",
            "tine.ip=10.0.0.2/24 tine.dns=1.1.1.1,nope",
        ] {
            assert!(parse_cmdline(bad).is_err(), "{bad}");
        }
    }
}
