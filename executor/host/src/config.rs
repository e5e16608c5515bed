//! The one value that configures a host: where its files live, which executable runs VMM
//! workers, and its limits. Built at the edge (the CLI) and passed down; nothing below reads
//! the environment.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tine_proto::limits::{DEFAULT_READY_TIMEOUT_MS, MAX_SPAWN};
use tine_proto::names::ExecutorId;

/// Who started a VM, recorded with it: the executor daemon adopts only its own VMs after a
/// restart, and `tine kill` leaves a daemon's VMs to the daemon.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "id", rename_all = "lowercase")]
pub enum Owner {
    /// `tine snapshot` / `tine fork` in a terminal.
    Cli,
    /// The executor daemon with this id.
    Executor(String),
}

impl Owner {
    pub fn executor(id: &ExecutorId) -> Owner {
        Owner::Executor(id.as_str().to_string())
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Cli => f.write_str("the tine CLI"),
            Owner::Executor(id) => write!(f, "executor {id}"),
        }
    }
}

/// What "ready" means for a spawned child.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Readiness {
    /// Its guest agent answers, and the clone got its own wall clock and RNG state (the
    /// normal case: every Tine image runs the agent).
    Agent,
    /// Its VMM restored the snapshot and runs the guest. For snapshots of guests without the
    /// agent (hand-made test guests, raw `tine run --snapshot-at` snapshots): nothing in the
    /// guest is fixed up.
    Running,
}

#[derive(Clone, Debug)]
pub struct Limits {
    /// Most VMs this host runs at once; spawns past it fail as [`crate::HostError::Full`].
    pub max_vms: u32,
    /// Idle VMM worker processes kept started (0: start one per spawn, and no growth).
    pub pool_size: usize,
    /// Most idle workers the pool grows to after spawns found it short: by as many as they
    /// started on demand (at most `pool_size`: it never grows; see [`crate::pool_size`]).
    pub pool_max: usize,
    /// A grown pool goes back to `pool_size` once no spawn found it short for this long.
    pub pool_shrink_after: Duration,
    /// Replace a taken worker in the background (a daemon), or only when asked (a one-shot
    /// `tine fork` that pre-starts what it needs before its clock starts).
    pub auto_refill: bool,
    /// Per-child readiness deadline when a spawn does not give one.
    pub ready_timeout: Duration,
    /// Boot + warm-up of a parent before its snapshot (minutes in the nested lab).
    pub parent_ready_timeout: Duration,
    /// Most memory (MiB of image data) held as copies of hot snapshots' memory in huge pages
    /// (see [`crate::hot`]); 0: none held unless asked ([`crate::Host::hold_image`]).
    pub hot_image_mib: u64,
    /// Open children's guest RAM to the host's page merging (KSM, `MADV_MERGEABLE`), so
    /// identical pages that siblings wrote are kept once. Off by default: it costs the KSM
    /// daemon's CPU, and merging across tenants lets one child time another's writes (a
    /// known side channel). Needs `/sys/kernel/mm/ksm/run` = 1 ([`crate::ksm`]).
    pub merge_pages: bool,
    /// How long after a child's guest starts its VMM gives back the guest RAM pages it holds
    /// privately but unchanged from the snapshot (pages written back as they were, or copied
    /// ahead with the working set and never changed), inside one short pause; they then map
    /// the snapshot's pages again, shared with its other children. None: never.
    pub give_back_after: Option<Duration>,
    /// Idle workers prime themselves for the snapshot last spawned from: its restore done up
    /// to what needs the child, its working set mapped (see [`crate::worker::PrimeJob`]). Each
    /// primed worker holds the pages that working set writes (under 1 MiB for python-numpy),
    /// charged to the executor rather than to a child.
    pub prime_workers: bool,
    /// How VMM workers are started: forked from a zygote, sharing the pages their program's
    /// loading wrote (the default), or each from the program, with an address-space layout
    /// of its own (see [`crate::zygote`]).
    pub worker_start: crate::zygote::WorkerStart,
}

/// Late enough that a child's Wake and the guest's own work after its resume are done.
pub const DEFAULT_GIVE_BACK_AFTER: Duration = Duration::from_secs(2);

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_vms: 256,
            pool_size: 8,
            pool_max: 32,
            pool_shrink_after: Duration::from_secs(300),
            auto_refill: true,
            ready_timeout: Duration::from_millis(DEFAULT_READY_TIMEOUT_MS as u64),
            parent_ready_timeout: Duration::from_secs(900),
            hot_image_mib: 2048,
            merge_pages: false,
            give_back_after: Some(DEFAULT_GIVE_BACK_AFTER),
            prime_workers: true,
            worker_start: crate::zygote::WorkerStart::Fork,
        }
    }
}

impl Limits {
    /// For one `tine fork` process: room for the largest spawn, no background workers.
    pub fn one_shot() -> Limits {
        Limits {
            max_vms: MAX_SPAWN,
            pool_size: 0,
            pool_max: 0,
            auto_refill: false,
            // It exits after one spawn: a copy filled after it would serve nobody.
            hot_image_mib: 0,
            ..Limits::default()
        }
    }
}

#[derive(Clone, Debug)]
pub struct HostConfig {
    /// `snapshots/<tag>/` and `vms/<id>/` live here.
    pub data_dir: PathBuf,
    /// Kernels and images (`tine image build`), to resolve image names.
    pub image_cache: PathBuf,
    /// The executable that runs a VMM worker: `<worker_exe> __vmm-worker`.
    pub worker_exe: PathBuf,
    pub owner: Owner,
    pub readiness: Readiness,
    pub limits: Limits,
    /// The cluster's store and this host's layer cache (None: snapshots stay on this host).
    pub store: Option<crate::layers::StoreConfig>,
    /// Children's networks (None: parents boot without a network interface and children
    /// get none).
    pub network: Option<crate::network::NetConfig>,
    /// Children's cgroups.
    pub cgroups: crate::cgroup::CgroupMode,
    /// Each VMM worker's user and system-call filter.
    pub confine: crate::confine::Confinement,
}

impl HostConfig {
    pub fn snapshots_dir(&self) -> PathBuf {
        self.data_dir.join("snapshots")
    }
    pub fn vms_dir(&self) -> PathBuf {
        self.data_dir.join("vms")
    }
}
