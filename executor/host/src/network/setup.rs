//! What makes a child network: its namespace, links, addresses and route in-process
//! ([`netns`], [`super::netlink`]), its rules with `nft`. Every name and address is made here
//! from an index or a checked [`Policy`].

use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use std::os::fd::AsRawFd;

use super::netlink::Rtnl;
use super::{netns, nftlib};
use super::{NetConfig, Policy, GATEWAY, GUEST_ADDR, GUEST_PREFIX, TAP, TAP_MAC};
use crate::error::{HostError, Result};

const NS_PREFIX: &str = "tine-";
/// Host-side veth names: `tinen<index>` (the host's rules match `tinen*`).
const VETH_PREFIX: &str = "tinen";
/// The veth end inside each namespace.
const NS_VETH: &str = "veth0";

pub(super) fn ns_name(index: u32) -> String {
    format!("{NS_PREFIX}{index}")
}

pub(super) fn ns_path(index: u32) -> PathBuf {
    Path::new("/run/netns").join(ns_name(index))
}

pub(super) fn index_of(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(NS_PREFIX)?;
    // Canonical form only, so a name maps to exactly one index.
    let i: u32 = digits.parse().ok()?;
    (i.to_string() == digits).then_some(i)
}

fn veth(index: u32) -> String {
    format!("{VETH_PREFIX}{index}")
}

/// The host's and the namespace's ends of link `index`.
pub(super) fn link_addrs(cfg: &NetConfig, index: u32) -> (Ipv4Addr, Ipv4Addr) {
    let base = u32::from(cfg.links.addr) + index * 4;
    (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2))
}

fn run(program: &str, args: &[&str], input: Option<&str>) -> Result<()> {
    let what = || format!("{program} {}", args.join(" "));
    let mut child = Command::new(program)
        .args(args)
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| HostError::Network {
            what: what(),
            reason: if e.kind() == std::io::ErrorKind::NotFound {
                format!("{program} is not installed (Debian: apt install nftables)")
            } else {
                e.to_string()
            },
        })?;
    if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
        // A failed write shows up as the command's own error below.
        let _ = stdin.write_all(text.as_bytes());
    }
    let out = child.wait_with_output().map_err(|e| HostError::Network {
        what: what(),
        reason: e.to_string(),
    })?;
    if !out.status.success() {
        let mut reason = String::from_utf8_lossy(&out.stderr).trim().to_string();
        if let Some(text) = input {
            reason.push_str(&format!("\ninput:\n{text}"));
        }
        return Err(HostError::Network {
            what: what(),
            reason,
        });
    }
    Ok(())
}

/// Apply a rule set (one transaction) in this thread's network namespace: through
/// libnftables when it is there ([`nftlib`]), else by `nft -f -`.
fn nft(rules: &str) -> Result<()> {
    match nftlib::apply(rules) {
        None => run("nft", &["-f", "-"], Some(rules)),
        Some(Ok(())) => Ok(()),
        Some(Err(said)) => Err(HostError::Network {
            what: "nft -f - (libnftables)".into(),
            reason: format!("{said}\ninput:\n{rules}"),
        }),
    }
}

pub(super) fn check_tools() -> Result<()> {
    run("nft", &["--version"], None)?;
    if !Path::new("/dev/net/tun").exists() {
        return Err(HostError::NetworkRefused(
            "/dev/net/tun is missing (load the tun module)".into(),
        ));
    }
    Ok(())
}

/// Routing between the children's links and the host's uplinks.
pub(super) fn enable_forwarding() -> Result<()> {
    let knob = "/proc/sys/net/ipv4/ip_forward";
    let on = std::fs::read_to_string(knob).is_ok_and(|v| v.trim() == "1");
    if !on {
        tracing::info!("turning on IPv4 forwarding ({knob}) for child networks");
        std::fs::write(knob, "1").map_err(HostError::io(format!("writing {knob}")))?;
    }
    Ok(())
}

/// The host's table of one executor (`name`, see [`host_table_name`]), replaced as a whole
/// (one transaction) at each start. Several executors on one host each have their own: a
/// packet any of them drops is dropped, so none can loosen another's deny list.
pub(super) fn install_host_table(name: &str, cfg: &NetConfig) -> Result<()> {
    let mut deny: Vec<String> = vec!["127.0.0.0/8".into(), "169.254.0.0/16".into()];
    deny.extend(cfg.deny.iter().map(|t| format!("{}/{}", t.addr, t.prefix)));
    // One rule per entry: overlapping entries in one set are refused by some nft versions.
    let deny_rules: String = deny
        .iter()
        .map(|d| format!("    iifname \"{VETH_PREFIX}*\" ip daddr {d} drop\n"))
        .collect();
    let nat = if cfg.masquerade {
        format!(
            "  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    \
             ip saddr {}/{} oifname != \"{VETH_PREFIX}*\" masquerade\n  }}\n",
            cfg.links.addr, cfg.links.prefix
        )
    } else {
        String::new()
    };
    let text = format!(
        "table inet {name}\ndelete table inet {name}\ntable inet {name} {{\n\
         \x20 chain input {{\n    type filter hook input priority filter - 10; policy accept;\n    \
         iifname \"{VETH_PREFIX}*\" ct state established,related accept\n    \
         iifname \"{VETH_PREFIX}*\" drop\n  }}\n\
         \x20 chain forward {{\n    type filter hook forward priority filter - 10; policy accept;\n    \
         iifname \"{VETH_PREFIX}*\" oifname \"{VETH_PREFIX}*\" drop\n    \
         oifname \"{VETH_PREFIX}*\" ct state established,related accept\n    \
         oifname \"{VETH_PREFIX}*\" drop\n{deny_rules}  }}\n{nat}}}\n"
    );
    nft(&text)
}

/// Remove an executor's host table (a benchmark's, when it is done).
pub(super) fn remove_host_table(name: &str) {
    if let Err(e) = run("nft", &["delete", "table", "inet", name], None) {
        tracing::warn!("removing host table {name}: {e}");
    }
}

/// The name of the host table of the executor whose data directory is `data_dir`: `tine_`
/// and a hash of the path (FNV-1a), the same at every start.
pub(super) fn host_table_name(data_dir: &Path) -> String {
    format!("tine_{:08x}", crate::cgroup::path_hash(data_dir))
}

/// Run `f` on a thread that has entered namespace `ns` (commands it starts run there too).
pub(super) fn in_netns<T: Send>(ns: &Path, f: impl FnOnce() -> Result<T> + Send) -> Result<T> {
    std::thread::scope(|s| {
        s.spawn(|| {
            setns(ns)?;
            f()
        })
        .join()
        .unwrap_or_else(|_| {
            Err(HostError::Network {
                what: format!("working in {}", ns.display()),
                reason: "the thread panicked".into(),
            })
        })
    })
}

fn setns(ns: &Path) -> Result<()> {
    let f = std::fs::File::open(ns).map_err(HostError::io(format!("opening {}", ns.display())))?;
    setns_file(&f, ns)
}

/// Enter the network namespace open as `f` (at `ns`, for errors).
pub(super) fn setns_file(f: &std::fs::File, ns: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: setns on an open namespace file; affects the calling thread only.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(HostError::io(format!("entering {}", ns.display()))(
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

pub(super) enum CreateError {
    /// The namespace exists already (another process took the index).
    Taken,
    Failed(HostError),
}

/// The MAC in [`TAP_MAC`] as bytes.
fn tap_mac() -> [u8; 6] {
    let mut mac = [0u8; 6];
    for (b, part) in mac.iter_mut().zip(TAP_MAC.split(':')) {
        *b = u8::from_str_radix(part, 16).expect("TAP_MAC is a MAC");
    }
    mac
}

/// Namespace `index` with its tap, its veth link to the host and the default policy: the
/// namespace, links, addresses and route made in-process (netlink, the tun device), its rules
/// by one `nft` run inside it.
pub(super) fn create(index: u32, cfg: &NetConfig) -> Result<(), CreateError> {
    let name = ns_name(index);
    let ns = ns_path(index);
    let (host, inner) = link_addrs(cfg, index);
    let v = veth(index);
    let failed = |what: &str, e: std::io::Error| {
        CreateError::Failed(HostError::Network {
            what: format!("{what} ({name})"),
            reason: e.to_string(),
        })
    };
    let made = netns::make(&ns, |caller| {
        // IPv4 only: nothing in the namespace speaks IPv6 (its rules are IPv4 rules); set
        // before its interfaces exist, so none of them gets an IPv6 address.
        for knob in [
            "/proc/sys/net/ipv6/conf/all/disable_ipv6",
            "/proc/sys/net/ipv6/conf/default/disable_ipv6",
        ] {
            if let Err(e) = std::fs::write(knob, "1") {
                tracing::debug!("{knob} in {name}: {e} (no IPv6 in this kernel?)");
            }
        }
        let knob = "/proc/sys/net/ipv4/ip_forward";
        std::fs::write(knob, "1")
            .map_err(|e| std::io::Error::new(e.kind(), format!("writing {knob}: {e}")))?;
        let mut rt = Rtnl::open()?;
        rt.set_up("lo", None)?;
        rt.add_veth(NS_VETH, &v, caller.as_raw_fd())?;
        tine_vmm::devices::virtio::net::Tap::open(TAP)
            .and_then(|t| t.persist())
            .map_err(std::io::Error::other)?;
        rt.set_up(TAP, Some(tap_mac()))?;
        rt.add_addr(TAP, GATEWAY, GUEST_PREFIX)?;
        rt.add_addr(NS_VETH, inner, 30)?;
        rt.set_up(NS_VETH, None)
    });
    match made {
        Ok(netns::Made::Taken) => return Err(CreateError::Taken),
        Ok(netns::Made::Done(())) => {}
        Err(e) => return Err(failed("making the namespace and its links", e)),
    }
    // The host's end, from the host's namespace (this thread's).
    Rtnl::open()
        .and_then(|mut rt| {
            rt.add_addr(&v, host, 30)?;
            rt.set_up(&v, None)
        })
        .map_err(|e| failed(&format!("setting up {v}"), e))?;
    in_netns(&ns, || {
        Rtnl::open()
            .and_then(|mut rt| rt.add_default_route(host))
            .map_err(|e| HostError::Network {
                what: format!("the default route via {host} in {name}"),
                reason: e.to_string(),
            })?;
        nft(&ns_table(cfg, index, &cfg.default_policy))
    })
    .map_err(CreateError::Failed)
}

/// The namespace's own table: address rewriting both ways and the egress policy.
fn ns_table(cfg: &NetConfig, index: u32, policy: &Policy) -> String {
    let (_, inner) = link_addrs(cfg, index);
    let egress: String = policy
        .egress_rules()
        .iter()
        .map(|r| format!("    {r}\n"))
        .collect();
    format!(
        "table ip tine\ndelete table ip tine\ntable ip tine {{\n\
         \x20 chain pre {{\n    type nat hook prerouting priority dstnat; policy accept;\n    \
         iifname \"{NS_VETH}\" ip daddr {inner} dnat to {GUEST_ADDR}\n  }}\n\
         \x20 chain post {{\n    type nat hook postrouting priority srcnat; policy accept;\n    \
         oifname \"{NS_VETH}\" ip saddr {GUEST_ADDR} snat to {inner}\n  }}\n\
         \x20 chain route {{\n    type filter hook forward priority filter; policy drop;\n    \
         iifname \"{TAP}\" ip saddr != {GUEST_ADDR} drop\n    \
         ct state established,related accept\n    \
         iifname \"{NS_VETH}\" oifname \"{TAP}\" ct status dnat accept\n    \
         iifname \"{TAP}\" oifname \"{NS_VETH}\" jump outbound\n  }}\n\
         \x20 chain outbound {{\n{egress}  }}\n\
         \x20 chain local {{\n    type filter hook input priority filter; policy accept;\n    \
         iifname \"{TAP}\" ct state established,related accept\n    \
         iifname \"{TAP}\" drop\n  }}\n}}\n"
    )
}

/// Replace namespace `index`'s rules with `policy` (one transaction).
pub(super) fn apply_policy(index: u32, cfg: &NetConfig, policy: &Policy) -> Result<()> {
    in_netns(&ns_path(index), || nft(&ns_table(cfg, index, policy)))
}

/// Remove namespace `index` and its links; what is already gone is not an error. True when
/// the namespace is gone.
pub(super) fn destroy(index: u32) -> bool {
    // The host end first and synchronously: a namespace is torn down in the background, and
    // its veth name must be free when the index is reused.
    if let Err(e) = Rtnl::open().and_then(|mut rt| rt.del_link(&veth(index))) {
        tracing::warn!("removing link {}: {e}", veth(index));
    }
    let ns = ns_path(index);
    if ns.exists() {
        if let Err(e) = netns::remove(&ns) {
            tracing::warn!("removing child network {}: {e}", ns.display());
        }
    }
    !ns.exists()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_one_index_only() {
        assert_eq!(index_of("tine-12"), Some(12));
        for bad in [
            "tine-012",
            "tine-",
            "tine-x",
            "other-1",
            "tine--1",
            "tine-1/../x",
        ] {
            assert_eq!(index_of(bad), None, "{bad}");
        }
        assert_eq!(index_of(&ns_name(7)), Some(7));
    }

    #[test]
    fn links_are_disjoint_thirty_twos() {
        let cfg = NetConfig::default();
        assert_eq!(
            link_addrs(&cfg, 0),
            (Ipv4Addr::new(10, 200, 0, 1), Ipv4Addr::new(10, 200, 0, 2))
        );
        assert_eq!(
            link_addrs(&cfg, 64),
            (Ipv4Addr::new(10, 200, 1, 1), Ipv4Addr::new(10, 200, 1, 2))
        );
        assert_eq!(cfg.capacity(), 16384);
    }

    #[test]
    fn the_namespace_table_forwards_to_the_guest_and_applies_the_policy() {
        let cfg = NetConfig::default();
        let t = ns_table(&cfg, 1, &cfg.default_policy);
        assert!(t.contains("ip daddr 10.200.0.6 dnat to 10.254.0.2"), "{t}");
        assert!(t.contains("snat to 10.200.0.6"), "{t}");
        // A guest cannot send as anyone else (a sibling's link address, say).
        assert!(
            t.contains("iifname \"tap0\" ip saddr != 10.254.0.2 drop"),
            "{t}"
        );
        assert!(t.contains("chain outbound {\n    accept\n  }"), "{t}");
    }
}
