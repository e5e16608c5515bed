//! The edge where `tine` turns its environment into configuration values: the data
//! directory, the image cache, and the [`HostConfig`] every local VM command uses. Nothing
//! below this module reads these variables.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use tine_host::network::{NetConfig, Policy, Target};
use tine_host::{Host, HostConfig, Limits, Owner, Readiness};
use tine_proto::names::ExecutorId;

/// `--data-dir`, else `$TINE_DATA_DIR`, else `$XDG_DATA_HOME/tine`, else `~/.local/share/tine`.
pub fn data_dir(flag: Option<PathBuf>) -> Result<PathBuf> {
    match flag {
        Some(d) => Ok(d),
        None => tine_snapshot_store::cli::data_dir(),
    }
}

/// Kernels and built images: `$TINE_CACHE_DIR`, else `~/.cache/tine`.
pub fn image_cache() -> PathBuf {
    tine_image::default_cache_dir()
}

/// The binary of the VMM workers: `tine-vmm-worker` beside this `tine` (`deploy/build.sh` and
/// `cargo build -p tine-cli` put it there), else `tine` itself, which runs the same worker.
/// `tine-vmm-worker` holds the worker alone, so each child's private copy of the binary's relocated
/// data is about 0.1 MiB instead of 0.65 (docs/performance.md).
pub fn worker_exe() -> Result<PathBuf> {
    let me = std::env::current_exe()?;
    let beside = me.with_file_name(WORKER_BINARY);
    let exe = if is_executable(&beside) { beside } else { me };
    tracing::info!(worker = %exe.display(), "VMM workers run from this executable");
    Ok(exe)
}

/// The VMM worker's own binary (`clients/cli/src/bin/tine-vmm-worker.rs`).
pub const WORKER_BINARY: &str = "tine-vmm-worker";

fn is_executable(p: &std::path::Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// The host configuration for VMs this `tine` process starts itself.
pub fn host_config(owner: Owner, limits: Limits, readiness: Readiness) -> Result<HostConfig> {
    Ok(HostConfig {
        data_dir: data_dir(None)?,
        image_cache: image_cache(),
        worker_exe: worker_exe()?,
        owner,
        readiness,
        limits,
        store: None,
        // Child networks are an executor's (`tine up`, `tine executor`).
        network: None,
        // Children of `tine fork` are confined as an executor's are, where the host can.
        cgroups: tine_host::CgroupMode::Auto,
        confine: tine_host::Confinement::default(),
    })
}

/// `--cgroup`: `auto`, `off`, or a cgroup v2 directory the executor owns.
pub fn cgroup_mode(flag: &str) -> tine_host::CgroupMode {
    match flag {
        "auto" => tine_host::CgroupMode::Auto,
        "off" => tine_host::CgroupMode::Off,
        dir => tine_host::CgroupMode::At(PathBuf::from(dir)),
    }
}

/// An executor's store settings; its layer cache lives in its data directory.
pub struct StoreChoice {
    pub url: String,
    pub fetch: tine_host::FetchMode,
    pub cache_max_bytes: Option<u64>,
    pub gc_grace: std::time::Duration,
}

/// The host configuration of an executor daemon (`tine up`, `tine executor`).
pub fn executor_host(
    id: &ExecutorId,
    data_dir: PathBuf,
    limits: Limits,
    store: Option<StoreChoice>,
    network: Option<NetConfig>,
    cgroups: tine_host::CgroupMode,
) -> Result<HostConfig> {
    let store = store.map(|s| tine_host::StoreConfig {
        url: s.url,
        layer_cache: data_dir.join("layers"),
        fetch: s.fetch,
        cache_max_bytes: s.cache_max_bytes,
        gc_grace: s.gc_grace,
    });
    Ok(HostConfig {
        store,
        data_dir,
        image_cache: image_cache(),
        worker_exe: worker_exe()?,
        owner: Owner::executor(id),
        readiness: Readiness::Agent,
        limits,
        network,
        cgroups,
        // Callers with `ConfineArgs` replace it.
        confine: tine_host::Confinement::default(),
    })
}

/// How an executor confines its VMM workers (`tine up`, `tine executor`).
#[derive(clap::Args, Clone, Debug)]
pub struct ConfineArgs {
    /// What a VMM's system call outside its seccomp allow-list does: enforce (the VMM dies
    /// with SIGSYS and its sandbox fails, saying which call), log (allowed, logged by the
    /// kernel: dmesg type=1326) or off.
    #[arg(long, default_value = "enforce")]
    pub vmm_seccomp: tine_host::SeccompMode,
    /// Each VMM runs as user and group BASE + its pid (root executors only), or `off` to
    /// keep them as the executor's user.
    #[arg(long, default_value_t = tine_host::confine::DEFAULT_UID_BASE.to_string())]
    pub vmm_uid_base: String,
}

impl ConfineArgs {
    pub fn confinement(&self) -> Result<tine_host::Confinement> {
        let uid_base = match self.vmm_uid_base.as_str() {
            "off" => None,
            n => Some(n.parse::<u32>().map_err(|e| {
                anyhow::anyhow!("--vmm-uid-base {n:?}: expected a user id or off ({e})")
            })?),
        };
        if uid_base == Some(0) {
            anyhow::bail!(
                "--vmm-uid-base 0 would run VMMs as root; use off to keep the executor's user"
            );
        }
        // Room above the base for every pid the kernel may hand out (pid_max <= 2^22).
        let top = u32::MAX - (1 << 22);
        if uid_base.is_some_and(|b| b > top) {
            anyhow::bail!("--vmm-uid-base must be at most {top}, to leave room for every pid");
        }
        Ok(tine_host::Confinement {
            seccomp: self.vmm_seccomp,
            uid_base,
            ..tine_host::Confinement::default()
        })
    }
}

/// An executor's child-network flags (`tine up`, `tine executor`).
#[derive(clap::Args, Clone, Debug)]
pub struct NetArgs {
    /// No child networks: parents boot without a network interface, children get none.
    #[arg(long)]
    pub no_network: bool,
    /// Internet access of spawns that do not say: allow or deny (`tine up`: allow;
    /// `tine executor`: deny).
    #[arg(long, value_parser = ["allow", "deny"])]
    pub net_internet: Option<String>,
    /// Never reachable from any child, whatever its spawn asks: CIDR (repeatable). The
    /// control plane's address is added when it is an IPv4 address.
    #[arg(long = "net-deny")]
    pub net_deny: Vec<String>,
    /// A resolver guests are told at boot (repeatable; default: the host's own nameservers
    /// unless they are loopback addresses).
    #[arg(long = "net-dns")]
    pub net_dns: Vec<Ipv4Addr>,
    /// The links to children's namespaces are /30s cut from this network.
    #[arg(long, default_value = "10.200.0.0/16")]
    pub net_links: String,
    /// Child networks kept prepared.
    #[arg(long, default_value_t = 4)]
    pub net_pool: usize,
    /// Most child networks kept prepared after spawns found too few: the pool grows by as
    /// many as they had to make on the spot, and goes back to --net-pool after 5 quiet minutes
    /// (at most --net-pool: it never grows).
    #[arg(long, default_value_t = 32)]
    pub net_pool_max: usize,
    /// Do not rewrite children's traffic to this host's address on its way out (only when
    /// the link network is routed to this host).
    #[arg(long)]
    pub net_no_masquerade: bool,
    /// Where exposed guest ports (`tine sandbox port`) listen on this host.
    #[arg(long, default_value = "127.0.0.1")]
    pub net_expose_ip: std::net::IpAddr,
}

impl NetArgs {
    /// The child-network configuration, `internet` being this command's default.
    pub fn config(&self, internet: bool, control_plane: Option<&str>) -> Result<Option<NetConfig>> {
        if self.no_network {
            return Ok(None);
        }
        let parse = |field: &str, v: &str| -> Result<Target> {
            v.parse::<Target>()
                .map_err(|e| anyhow::anyhow!("--{field}: {e}"))
        };
        let mut deny = self
            .net_deny
            .iter()
            .map(|d| parse("net-deny", d))
            .collect::<Result<Vec<_>>>()?;
        if let Some(t) = deny.iter().find(|t| t.port.is_some()) {
            anyhow::bail!("--net-deny {t}: host-wide entries are whole networks, without a port");
        }
        if let Some(url) = control_plane {
            for ip in control_plane_ipv4s(url)? {
                deny.push(Target {
                    addr: ip,
                    prefix: 32,
                    port: None,
                });
            }
        }
        let dns = if self.net_dns.is_empty() {
            host_nameservers()
        } else {
            self.net_dns.clone()
        };
        Ok(Some(NetConfig {
            default_policy: Policy {
                internet: match self.net_internet.as_deref() {
                    Some(v) => v == "allow",
                    None => internet,
                },
                ..Policy::default()
            },
            deny,
            dns,
            links: parse("net-links", &self.net_links)?,
            pool: self.net_pool,
            pool_max: self.net_pool_max,
            pool_shrink_after: NetConfig::default().pool_shrink_after,
            masquerade: !self.net_no_masquerade,
            expose_ip: self.net_expose_ip,
        }))
    }
}

/// The IPv4 addresses of the control plane in `url` (`https://cp.internal:7070`), resolved
/// now, without loopback ones (loopback is out of every child's reach anyway). A name that
/// does not resolve is an error: children must not be able to reach a control plane that
/// the executor could not keep out of their reach.
fn control_plane_ipv4s(url: &str) -> Result<Vec<Ipv4Addr>> {
    use std::net::ToSocketAddrs;
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
    if let Ok(ip) = host.parse::<Ipv4Addr>() {
        return Ok(if ip.is_loopback() { vec![] } else { vec![ip] });
    }
    let addrs = (host, 0).to_socket_addrs().with_context(|| {
        format!("resolving the control plane's host {host:?} to keep children away from it")
    })?;
    let mut v4: Vec<Ipv4Addr> = addrs
        .filter_map(|a| match a.ip() {
            std::net::IpAddr::V4(ip) if !ip.is_loopback() => Some(ip),
            _ => None,
        })
        .collect();
    v4.sort();
    v4.dedup();
    Ok(v4)
}

/// The host's resolvers from /etc/resolv.conf, without loopback ones (a guest cannot reach
/// the host's own stub resolver).
fn host_nameservers() -> Vec<Ipv4Addr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<Ipv4Addr>().ok())
        .filter(|a| !a.is_loopback())
        .collect()
}

/// `--give-back-after`: seconds, finite and not negative.
pub fn parse_give_back_after(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=86_400.0).contains(&v) => Ok(v),
        _ => Err(format!("{s:?} is not a number of seconds from 0 to 86400")),
    }
}

/// [`Limits::give_back_after`] from `--give-back-after` seconds (0: never).
pub fn give_back_after(secs: f64) -> Option<std::time::Duration> {
    (secs > 0.0).then(|| std::time::Duration::from_secs_f64(secs))
}

/// The host as the CLI's own commands (`tine snapshot/fork/ls/kill`, benches) see it.
/// `prime`: idle workers prime themselves for the snapshot forked from ([`Limits::prime_workers`]);
/// `start`: how its VMM workers are started ([`Limits::worker_start`]).
pub fn cli_host(readiness: Readiness, prime: bool, start: tine_host::WorkerStart) -> Result<Host> {
    Ok(Host::open(host_config(
        Owner::Cli,
        Limits {
            prime_workers: prime,
            worker_start: start,
            ..Limits::one_shot()
        },
        readiness,
    )?)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vmm_users_are_a_base_or_off_never_root() {
        let args = |base: &str| ConfineArgs {
            vmm_seccomp: tine_host::SeccompMode::Enforce,
            vmm_uid_base: base.into(),
        };
        assert_eq!(args("off").confinement().unwrap().uid_base, None);
        assert_eq!(args("70000").confinement().unwrap().uid_base, Some(70000));
        let e = args("0").confinement().unwrap_err().to_string();
        assert!(e.contains("as root"), "{e}");
        let e = args("4294967000").confinement().unwrap_err().to_string();
        assert!(e.contains("room for every pid"), "{e}");
        let e = args("lots").confinement().unwrap_err().to_string();
        assert!(e.contains("expected a user id or off"), "{e}");
    }

    #[test]
    fn the_control_plane_is_kept_out_of_childrens_reach() {
        let ip = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        assert_eq!(
            control_plane_ipv4s("https://10.0.0.5:7070").unwrap(),
            [ip("10.0.0.5")]
        );
        assert_eq!(
            control_plane_ipv4s("http://10.0.0.5").unwrap(),
            [ip("10.0.0.5")]
        );
        // Loopback is out of every child's reach already.
        assert!(control_plane_ipv4s("http://127.0.0.1:7070")
            .unwrap()
            .is_empty());
        assert!(control_plane_ipv4s("http://localhost:7070")
            .unwrap()
            .is_empty());
        assert!(control_plane_ipv4s("https://no-such-host.invalid:7070").is_err());
    }

    #[test]
    fn host_wide_deny_entries_have_no_port() {
        let args = NetArgs {
            no_network: false,
            net_internet: None,
            net_deny: vec!["10.0.0.0/8:22".into()],
            net_dns: vec![],
            net_links: "10.200.0.0/16".into(),
            net_pool: 1,
            net_pool_max: 1,
            net_no_masquerade: false,
            net_expose_ip: "127.0.0.1".parse().unwrap(),
        };
        let e = args.config(false, None).unwrap_err().to_string();
        assert!(e.contains("without a port"), "{e}");
    }
}
