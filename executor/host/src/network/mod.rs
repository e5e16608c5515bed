//! Each child's network: a namespace of its own holding the tap its VMM attaches to, linked
//! to the host by a veth pair with a unique /30, with the child's egress policy in the
//! namespace's nftables table and the host-wide rules in the host's.
//!
//! Every guest has the same address, gateway and MAC (the ones its parent booted with), so a
//! clone needs no reconfiguration; the namespace rewrites its traffic to the link's unique
//! address on the way out and forwards connections to that address to the guest (exposed
//! ports). Namespaces are prepared ahead, with the default policy, in a small pool.
//!
//! Host-wide, whatever a spawn asks: no child reaches the host's own addresses (its gRPC
//! port, SSH...), link-local addresses (cloud metadata), loopback, the operator's deny list
//! (the control plane), or another child; nothing from outside reaches a child except
//! replies and what the host forwards to it.

pub mod expose;
mod netlink;
mod netns;
mod nftlib;
mod policy;
mod setup;

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

pub use policy::{Policy, Target, TargetError, MAX_ENTRIES};

use crate::error::{HostError, Result};
use crate::pool_size::{PoolBounds, PoolSize};

/// The guest's side, the same in every guest and every clone.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(10, 254, 0, 2);
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 254, 0, 1);
pub const GUEST_PREFIX: u8 = 30;
pub const GUEST_MAC: [u8; 6] = [0x06, 0x00, 0x0a, 0xfe, 0x00, 0x02];
/// The tap's MAC, fixed too: a restored guest's ARP cache still names the parent's gateway.
pub const TAP_MAC: &str = "06:00:0a:fe:00:01";
/// The tap's name inside each namespace.
pub const TAP: &str = "tap0";

/// How an executor networks its children. Built at the edge, passed down.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    /// The policy of a spawn that does not give one.
    pub default_policy: Policy,
    /// Never reachable from any child, whatever its policy (e.g. the control plane).
    pub deny: Vec<Target>,
    /// Resolvers the guest is told at boot (none: no resolv.conf).
    pub dns: Vec<Ipv4Addr>,
    /// The /30 links between the host and each namespace are cut from this network.
    pub links: Target,
    /// Namespaces kept prepared (0: one is made per spawn, and the pool never grows).
    pub pool: usize,
    /// Most namespaces the pool grows to after spawns found it short, by as many as they
    /// made on the spot (at most `pool`: it never grows; see [`crate::pool_size`]).
    pub pool_max: usize,
    /// A grown pool goes back to `pool` once no spawn found it short for this long.
    pub pool_shrink_after: std::time::Duration,
    /// Rewrite children's traffic to the host's address when it leaves the host (needed to
    /// reach anything that has no route back to `links`).
    pub masquerade: bool,
    /// Where exposed guest ports listen on the host.
    pub expose_ip: std::net::IpAddr,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            default_policy: Policy {
                internet: true,
                ..Policy::default()
            },
            deny: Vec::new(),
            dns: Vec::new(),
            links: Target {
                addr: Ipv4Addr::new(10, 200, 0, 0),
                prefix: 16,
                port: None,
            },
            pool: 4,
            pool_max: 32,
            pool_shrink_after: std::time::Duration::from_secs(300),
            masquerade: true,
            expose_ip: std::net::IpAddr::V4(Ipv4Addr::LOCALHOST),
        }
    }
}

impl NetConfig {
    /// The kernel command line words that configure the guest's interface at boot (read by
    /// the agent).
    pub fn guest_cmdline(&self) -> String {
        let mut s = format!("tine.ip={GUEST_ADDR}/{GUEST_PREFIX} tine.gw={GATEWAY}");
        if !self.dns.is_empty() {
            let dns: Vec<String> = self.dns.iter().map(|a| a.to_string()).collect();
            s.push_str(&format!(" tine.dns={}", dns.join(",")));
        }
        s
    }

    /// How many /30 links `links` holds.
    fn capacity(&self) -> u32 {
        (1u64 << (32 - self.links.prefix as u32))
            .div_ceil(4)
            .min(u32::MAX as u64) as u32
    }
}

/// One prepared namespace, ready for a VMM to attach to its tap.
#[derive(Debug)]
pub struct Lease {
    index: u32,
    policy: Policy,
}

impl Lease {
    /// The namespace's name (`ip netns`), also its record in the data directory.
    pub fn name(&self) -> String {
        setup::ns_name(self.index)
    }

    /// The namespace's file, for `setns`.
    pub fn path(&self) -> PathBuf {
        setup::ns_path(self.index)
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }
}

/// The host's child networks: the host-wide rules, the pool, and every lease, each recorded
/// as a file under `<data>/net/` from before its namespace exists until after it is gone.
pub struct Network {
    cfg: NetConfig,
    /// This executor's table in the host's nftables (`inet <name>`).
    host_table: String,
    /// The pool was drained: a refill still running releases what it makes. Set under the
    /// `idle` lock, so a refill's check and push cannot straddle the drain.
    closed: AtomicBool,
    leases: PathBuf,
    idle: Mutex<Vec<Lease>>,
    /// How many to keep prepared: `pool`, grown after bursts made namespaces on the spot.
    size: PoolSize,
    next: AtomicU32,
    refilling: AtomicBool,
    /// The latest refill thread, joined by the drain: once the host is closed, nothing is
    /// still being made.
    refill: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Network {
    /// Check the tools, turn on forwarding and install the host's table.
    pub fn open(cfg: NetConfig, data_dir: &Path) -> Result<Arc<Network>> {
        if cfg.links.port.is_some() || cfg.links.prefix > 30 {
            return Err(HostError::NetworkRefused(format!(
                "the link network {} must be a CIDR of /30 or larger, without a port",
                cfg.links
            )));
        }
        setup::check_tools()?;
        setup::enable_forwarding()?;
        let host_table = setup::host_table_name(data_dir);
        setup::install_host_table(&host_table, &cfg)?;
        let leases = data_dir.join("net");
        std::fs::create_dir_all(&leases)
            .map_err(HostError::io(format!("creating {}", leases.display())))?;
        let size = PoolSize::new(PoolBounds {
            floor: cfg.pool,
            ceiling: cfg.pool_max,
            shrink_after: cfg.pool_shrink_after,
        });
        let net = Arc::new(Network {
            cfg,
            host_table,
            closed: AtomicBool::new(false),
            leases,
            idle: Mutex::new(Vec::new()),
            size,
            next: AtomicU32::new(0),
            refilling: AtomicBool::new(false),
            refill: Mutex::new(None),
        });
        Ok(net)
    }

    pub fn config(&self) -> &NetConfig {
        &self.cfg
    }

    /// This executor's table in the host's nftables (`nft list table inet NAME`).
    pub fn host_table(&self) -> &str {
        &self.host_table
    }

    /// Drain the pool and remove this executor's host table (a temporary executor, e.g. a
    /// benchmark's, when it is done; a daemon's children need the table after it exits).
    pub fn remove_host_table(&self) {
        self.drain_pool();
        setup::remove_host_table(&self.host_table);
    }

    /// Namespaces recorded here (in use, pooled, or left behind).
    pub fn recorded(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.leases)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| setup::index_of(n).is_some())
            .collect();
        names.sort();
        names
    }

    /// Remove the namespaces recorded here that are not in `keep` (after a restart: the
    /// ones no surviving child uses).
    pub fn sweep(&self, keep: &HashSet<String>) {
        for name in self.recorded() {
            if !keep.contains(&name) {
                tracing::info!(ns = %name, "removing a child network left behind");
                self.release_name(&name);
            }
        }
    }

    /// A namespace with `policy` in force: a pooled one when there is one (the caller tops
    /// the pool up afterwards, [`refill_in_background`](Self::refill_in_background)).
    pub fn take(self: &Arc<Self>, policy: &Policy) -> Result<Lease> {
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut lease = match pooled {
            Some(l) => l,
            None => {
                self.size.missed(std::time::Instant::now());
                self.prepare()?
            }
        };
        if lease.policy != *policy {
            if let Err(e) = setup::apply_policy(lease.index, &self.cfg, policy) {
                self.release(lease);
                return Err(e);
            }
            lease.policy = policy.clone();
        }
        Ok(lease)
    }

    /// Prepared namespaces waiting in the pool.
    pub fn idle(&self) -> usize {
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Namespaces the pool keeps prepared now.
    pub fn pool_target(&self) -> usize {
        self.size.target()
    }

    /// Prepare namespaces until the pool holds its target, grown first by what spawns found
    /// missing since.
    pub fn fill(&self) {
        self.size.grow();
        loop {
            if self.closed.load(Ordering::Acquire)
                || self.idle.lock().unwrap_or_else(|p| p.into_inner()).len() >= self.size.target()
            {
                return;
            }
            match self.prepare() {
                Ok(l) => {
                    let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                    if self.closed.load(Ordering::Acquire) {
                        drop(idle);
                        self.release(l);
                        return;
                    }
                    idle.push(l);
                }
                Err(e) => {
                    tracing::warn!("preparing a child network for the pool: {e}");
                    return;
                }
            }
        }
    }

    /// Top the pool up from a thread of lowest priority. Called once a spawn's children are
    /// ready rather than as each takes a namespace, so the refill does not compete with them.
    pub fn refill_in_background(self: &Arc<Self>) {
        // Held while deciding and spawning, so a drain either sees this thread or stops it
        // from starting.
        let mut refill = self.refill.lock().unwrap_or_else(|p| p.into_inner());
        if self.cfg.pool == 0
            || self.closed.load(Ordering::Acquire)
            || self.refilling.swap(true, Ordering::AcqRel)
        {
            return;
        }
        let net = self.clone();
        // The thread before has finished (`refilling` was clear), so it needs no join.
        *refill = Some(std::thread::spawn(move || {
            background_priority();
            net.fill();
            net.refilling.store(false, Ordering::Release);
        }));
    }

    /// Back to its floor once no spawn found the pool short for its quiet period: the surplus
    /// namespaces are removed by the same background thread as a refill (so a drain waits
    /// for it). Cheap when there is nothing to do: the daemon calls it every second.
    pub fn shrink_if_quiet(self: &Arc<Self>) {
        let mut refill = self.refill.lock().unwrap_or_else(|p| p.into_inner());
        if self.closed.load(Ordering::Acquire) || self.refilling.swap(true, Ordering::AcqRel) {
            return;
        }
        let surplus: Vec<Lease> = match self.size.shrink(std::time::Instant::now()) {
            None => Vec::new(),
            Some(target) => {
                let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                let n = idle.len().saturating_sub(target);
                idle.drain(..n).collect()
            }
        };
        if surplus.is_empty() {
            self.refilling.store(false, Ordering::Release);
            return;
        }
        tracing::info!(
            removed = surplus.len(),
            "child networks: the pool goes back to its floor after a quiet period"
        );
        let net = self.clone();
        *refill = Some(std::thread::spawn(move || {
            background_priority();
            for l in surplus {
                net.release(l);
            }
            // Spawns that took from the pool meanwhile asked for a refill this thread kept
            // from starting: top it up to the floor.
            net.fill();
            net.refilling.store(false, Ordering::Release);
        }));
    }

    /// A new namespace with the default policy, at the first free index.
    fn prepare(&self) -> Result<Lease> {
        let capacity = self.cfg.capacity();
        for _ in 0..capacity {
            let index = self.next.fetch_add(1, Ordering::Relaxed) % capacity;
            let name = setup::ns_name(index);
            if setup::ns_path(index).exists() {
                continue;
            }
            // Recorded first: a process killed mid-way leaves a record the next one sweeps.
            let record = self.leases.join(&name);
            std::fs::write(&record, b"")
                .map_err(HostError::io(format!("recording {}", record.display())))?;
            match setup::create(index, &self.cfg) {
                Ok(()) => {
                    return Ok(Lease {
                        index,
                        policy: self.cfg.default_policy.clone(),
                    })
                }
                // Another executor on this host took the index first.
                Err(setup::CreateError::Taken) => {
                    let _ = std::fs::remove_file(&record);
                }
                Err(setup::CreateError::Failed(e)) => {
                    setup::destroy(index);
                    let _ = std::fs::remove_file(&record);
                    return Err(e);
                }
            }
        }
        Err(HostError::NetworkRefused(format!(
            "all {capacity} child networks of {} are in use",
            self.cfg.links
        )))
    }

    /// The address on the host's side that reaches the guest of child network `name` (its
    /// namespace forwards it to the guest).
    pub fn guest_address(&self, name: &str) -> Option<Ipv4Addr> {
        setup::index_of(name).map(|i| setup::link_addrs(&self.cfg, i).1)
    }

    /// Remove a lease's namespace, links and rules.
    pub fn release(&self, lease: Lease) {
        self.release_name(&lease.name());
    }

    /// Remove the namespace called `name` (as recorded with a VM).
    pub fn release_name(&self, name: &str) {
        remove_recorded(&self.leases, name);
    }

    /// Remove the pooled namespaces (the host is closing).
    pub fn drain_pool(&self) {
        let idle: Vec<Lease> = {
            let mut idle = self.idle.lock().unwrap_or_else(|p| p.into_inner());
            self.closed.store(true, Ordering::Release);
            std::mem::take(&mut *idle)
        };
        for l in idle {
            self.release(l);
        }
        // A refill making a namespace right now releases it when it sees `closed`: wait for
        // that, so a closed host leaves no namespace behind even for a moment.
        let refill = self.refill.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = refill {
            let _ = t.join();
        }
    }
}

/// Lowest CPU priority for the calling thread and what it starts (threads and processes
/// inherit it): preparing namespaces ahead must not take CPU from children being made ready.
pub fn background_priority() {
    // SAFETY: plain syscalls on the calling thread.
    unsafe {
        let tid = libc::gettid();
        libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19);
    }
}

/// A name this module gives child networks (`tine-<n>`).
pub fn is_child_network(name: &str) -> bool {
    setup::index_of(name).is_some()
}

/// Remove child network `name` recorded in `leases` (`<data>/net`), with or without a
/// [`Network`] at hand (the CLI removing a VM it recorded).
pub fn remove_recorded(leases: &Path, name: &str) {
    let Some(index) = setup::index_of(name) else {
        tracing::warn!(ns = %name, "not a child network name; left alone");
        return;
    };
    // A namespace that could not be removed keeps its record: the next start sweeps it.
    if setup::destroy(index) {
        let _ = std::fs::remove_file(leases.join(name));
    }
}

/// Open the tap of namespace `ns` from a thread that enters it, leaving the caller's own
/// namespace alone (a parent VM runs inside the multi-threaded daemon).
pub fn open_tap_in(ns: &Path) -> Result<tine_vmm::devices::virtio::net::Tap> {
    setup::in_netns(ns, || {
        tine_vmm::devices::virtio::net::Tap::open(TAP).map_err(|e| HostError::Network {
            what: format!("opening {TAP} in {}", ns.display()),
            reason: e.to_string(),
        })
    })
}

/// Move the calling thread into the namespace open as `ns` (found at `path`) for good (a VMM
/// worker, before it restores).
pub fn enter(ns: &std::fs::File, path: &Path) -> Result<()> {
    setup::setns_file(ns, path)
}
