//! [`Host`]: the one owner of the VMs on a host. The executor daemon and the `tine` CLI both
//! go through it, so there is one spawn path, one set of limits and one record format.

use crate::process::VmmProcess;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tine_vmm::kvm_stats::Counters;
use tine_vmm::vm::Rebase;

use tine_proto::names::{SandboxId, Tag};
use tine_vmm::snapshot::file::{SnapshotHeader, MEMORY_FILE};

use crate::cgroup::{CgroupError, CgroupMode, CgroupName, Cgroups, ChildLimits, Usage};
use crate::config::{HostConfig, Readiness};
use crate::error::{HostError, Result};
use crate::fetch::{FetchMode, Fetcher, Source};
use crate::layers::{Fetched, Layers};
use crate::lazy::{ChildPages, FileImage, Pages};
use crate::network::{Network, Policy};
use crate::parent::{MadeSnapshot, ParentSpec};
use crate::process::{Liveness, ProcessIdentity};
use crate::ready::{make_ready, vmm_log, SpawnPhases};
use crate::records::{self, now_ms, VmRecord};
use crate::worker::{JobMemory, JobVm, WorkerJob, WorkerPool, WORKER_SUBCOMMAND};

/// Children set up at once by one spawn call: each is a thread that mostly waits (for its
/// worker, then its agent); past a few hundred they only cost memory and scheduler time.
const MAX_CONCURRENT_SPAWNS: usize = 256;

/// Longest a branch may keep the host waiting (a complete image of a large guest included).
const BRANCH_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a snapshot's recording child runs on after it is ready: as long again as it took
/// to get there, within these bounds (see `record_working_set`).
const RECORD_PAST_READY: (Duration, Duration) =
    (Duration::from_millis(100), Duration::from_secs(1));

/// A running VM snapshotted as a snapshot of its own.
#[derive(Clone, Debug)]
pub struct Branch {
    pub tag: Tag,
    /// What a diff applies over: the snapshot the VM was forked from, or its latest branch
    /// (for a full branch: the snapshot it was forked from).
    pub parent: Tag,
    pub kind: crate::control::BranchKind,
    pub dir: PathBuf,
    pub header: SnapshotHeader,
    /// How long the VM was paused.
    pub paused: Duration,
    /// Pages the diff holds: those the VM wrote since its parent (for a full branch: since
    /// it was forked).
    pub pages_written: u64,
    /// The whole call, as the caller waited for it.
    pub took: Duration,
    /// Its layer in the cluster's store (None: this host has no store).
    pub layer: Option<crate::layers::LayerInfo>,
    /// The VM taken onto this branch as its new diff base (None: a full branch, or it could
    /// not be, which the log says).
    pub rebase: Option<Rebase>,
}

/// A branching VM runs again; its snapshot is being written.
#[derive(Clone, Debug)]
pub struct Resumed {
    pub paused: Duration,
    /// What the branch applies over (as [`Branch::parent`]).
    pub parent: Tag,
}

/// A VM this host started or re-adopted.
struct Live {
    record: VmRecord,
    /// Our own child process (None for one adopted after a restart).
    child: Option<VmmProcess>,
    /// Made ready; until then its spawn thread owns it (the reaper leaves it alone).
    ready: bool,
}

/// Everything about this host's VMs that must change together, under one lock.
#[derive(Default)]
struct Vms {
    live: HashMap<SandboxId, Live>,
    /// Children a spawn accepted that are not live yet; `true` once a kill cancelled them.
    pending: HashMap<SandboxId, bool>,
    /// Slots reserved by children being handed to a worker (counted against `max_vms`).
    starting: usize,
}

/// Per-spawn choices; the host's limits bound them.
#[derive(Clone, Debug, Default)]
pub struct SpawnOptions {
    /// None: the host's `ready_timeout`.
    pub ready_timeout: Option<Duration>,
    /// At most this many children restoring at once (0: all of them).
    pub parallel: usize,
    /// None: the host's readiness.
    pub readiness: Option<Readiness>,
    /// The snapshot's head layer, recorded by the control plane: a host without the snapshot
    /// fetches this chain from the store (verified against these digests) before restoring.
    pub layer: Option<tine_snapshot_store::Digest>,
    /// How to restore when the snapshot is only in the store (None: the host's mode).
    pub fetch: Option<FetchMode>,
    /// The children's egress policy (None: the host's default). Refused on a host without
    /// networking or for a snapshot whose guest has no network interface.
    pub network: Option<Policy>,
    /// What each child is held to (zeros: the defaults). Refused on a host without cgroups.
    pub resources: Resources,
}

/// What a spawn asks each child to be held to; checked against [`ChildLimits::for_child`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resources {
    /// 0: the guest's RAM plus the VMM's overhead.
    pub memory_limit_mib: u64,
    /// Thousandths of a core (0: unlimited).
    pub cpu_millis: u32,
}

impl Resources {
    fn asked(&self) -> bool {
        *self != Resources::default()
    }
}

/// A child whose VMM exited (or was killed for want of memory) while it was ready.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ended {
    pub id: SandboxId,
    /// How it ended and the tail of its vmm.log.
    pub reason: String,
    /// Killed by the kernel for exceeding its memory limit.
    pub out_of_memory: bool,
}

/// Where a child's guest RAM comes from, as the host hands it over.
#[derive(Clone, Copy)]
enum Memory<'a> {
    /// The worker maps the snapshot's memory file.
    Image,
    /// Pages served by this host on first touch.
    Lazy,
    /// The image this host holds, sent to the worker with its job.
    Held(&'a Arc<std::fs::File>),
}

impl Memory<'_> {
    fn job(self) -> JobMemory {
        match self {
            Memory::Image => JobMemory::Image,
            Memory::Lazy => JobMemory::Lazy,
            Memory::Held(_) => JobMemory::Held,
        }
    }
}

/// What every child of one spawn call is made from.
#[derive(Clone, Copy)]
struct ChildPlan<'a> {
    tag: &'a Tag,
    snapshot: &'a std::path::Path,
    readiness: Readiness,
    timeout: Duration,
    /// Pages served by this host (a lazy restore).
    lazy: Option<&'a Arc<dyn Pages>>,
    /// The snapshot's memory image held by this host (None: the worker maps the file).
    image: Option<&'a Arc<std::fs::File>>,
    /// Its network's policy (None: no network).
    policy: Option<&'a Policy>,
    /// Its cgroup's limits (None: no cgroup).
    limits: Option<&'a ChildLimits>,
    /// Its VMM gives back the pages it holds unchanged ([`Limits::give_back_after`]); not a
    /// child recorded for the snapshot's page lists, whose copies are what it records.
    give_back: bool,
}

/// How one child of a spawn ended.
#[derive(Debug)]
pub struct SpawnOutcome {
    pub id: SandboxId,
    /// Its VMM process, once one was handed the job.
    pub pid: Option<u32>,
    pub result: Result<SpawnPhases>,
    /// For a child restored lazily: what its pages cost until it was ready.
    pub lazy: Option<LazyReport>,
}

/// What a lazily restored child needed until it was ready.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LazyReport {
    /// Page faults the host served.
    pub faults: u64,
    /// Pages copied in (faults' blocks and prefetched working set) and zero pages mapped.
    pub pages_copied: u64,
    pub pages_zeroed: u64,
    pub pages_prefetched: u64,
    /// Entries of the working set it was given (0: none recorded yet, or prefetch off).
    pub working_set_pages: u64,
    /// Bytes this host had fetched from the store for the snapshot by then (all children).
    pub fetched_bytes: u64,
    pub fetched_objects: u64,
}

/// A VM as `list` reports it.
#[derive(Clone, Debug)]
pub struct VmInfo {
    pub record: VmRecord,
    pub liveness: Liveness,
}

pub struct Host {
    cfg: HostConfig,
    pool: Arc<WorkerPool>,
    vms: Mutex<Vms>,
    /// The cluster's store and this host's layer cache.
    fetcher: Option<Arc<Fetcher>>,
    /// Children's networks (None: no network interfaces).
    network: Option<Arc<Network>>,
    /// Guest ports exposed on this host, per child; closed with it.
    exposed: Mutex<HashMap<SandboxId, Vec<crate::network::expose::Forward>>>,
    /// Children's cgroups (None: children run unconfined; see `no_cgroups`).
    cgroups: Option<Arc<Cgroups>>,
    /// Why children get no cgroups (refused to a spawn that asks for limits).
    no_cgroups: String,
    /// Snapshots (by state checksum) whose memory files this host's cgroup was charged for,
    /// and those files themselves (shared along a diff chain).
    charged: Mutex<Charged>,
    /// Tags whose parents are being booted and snapshotted here (one attempt per tag).
    making: Mutex<HashSet<Tag>>,
    /// Hot snapshots' memory images, held in huge pages for their children.
    held: crate::hot::HeldImages,
    /// Held while an executor daemon owns this data directory.
    _lock: Option<crate::pidlock::PidLock>,
}

impl Host {
    /// A host for the CLI: no lock on the data directory, no adoption.
    pub fn open(cfg: HostConfig) -> Result<Host> {
        Host::build(cfg, None)
    }

    /// A host for the executor daemon: takes the data directory (one daemon per directory)
    /// and re-adopts the VMs a previous daemon with the same owner left running.
    pub fn open_exclusive(cfg: HostConfig) -> Result<Host> {
        std::fs::create_dir_all(&cfg.data_dir).map_err(HostError::io(format!(
            "creating {}",
            cfg.data_dir.display()
        )))?;
        let lock = lock_dir(&cfg.data_dir)?;
        let host = Host::build(cfg, Some(lock))?;
        if let Some(f) = &host.fetcher {
            f.sweep();
        }
        host.adopt_survivors();
        if let Some(cg) = &host.cgroups {
            let keep = host
                .vms()
                .live
                .values()
                .map(|l| l.record.cgroup_name().as_str().to_string())
                .collect();
            cg.sweep(&keep);
        }
        if let Some(net) = &host.network {
            let keep = host
                .vms()
                .live
                .values()
                .filter_map(|l| l.record.net.clone())
                .collect();
            net.sweep(&keep);
        }
        Ok(host)
    }

    fn build(cfg: HostConfig, lock: Option<crate::pidlock::PidLock>) -> Result<Host> {
        for d in [cfg.snapshots_dir(), cfg.vms_dir()] {
            std::fs::create_dir_all(&d)
                .map_err(HostError::io(format!("creating {}", d.display())))?;
        }
        // SAFETY: geteuid has no preconditions.
        if cfg.confine.uid_base.is_some() && unsafe { libc::geteuid() } == 0 {
            // VMMs under users of their own pass through to the branch directories lent to
            // them (and read the snapshots their memory is a diff over), but cannot list them.
            use std::os::unix::fs::PermissionsExt;
            let d = cfg.snapshots_dir();
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o711)).map_err(
                HostError::io(format!("opening {} to VMM users", d.display())),
            )?;
        }
        if cfg.limits.merge_pages {
            if let Some(why) = crate::ksm::refusal(std::path::Path::new(crate::ksm::RUN)) {
                return Err(HostError::PageMerging(why));
            }
        }
        // Before any worker starts: the executor may move itself into its own leaf cgroup.
        let (cgroups, no_cgroups) = match Cgroups::open(&cfg.cgroups, &cfg.data_dir) {
            Ok(Some(c)) => (Some(Arc::new(c)), String::new()),
            Ok(None) => (
                None,
                "this executor runs without cgroups (--cgroup off)".into(),
            ),
            Err(CgroupError::Unavailable(why)) if cfg.cgroups == CgroupMode::Auto => {
                tracing::warn!("children run without cgroups, so without limits: {why}");
                (
                    None,
                    format!("this executor cannot give children cgroups: {why}"),
                )
            }
            Err(e) => return Err(HostError::Cgroup(e.to_string())),
        };
        let pool = WorkerPool::new(
            cfg.worker_exe.clone(),
            crate::pool_size::PoolBounds {
                floor: cfg.limits.pool_size,
                ceiling: cfg.limits.pool_max,
                shrink_after: cfg.limits.pool_shrink_after,
            },
            cfg.limits.auto_refill,
            cgroups.clone(),
            cfg.limits.worker_start,
        );
        let fetcher = match &cfg.store {
            Some(store) => Some(Arc::new(Fetcher::new(
                Layers::open(store)?,
                cfg.snapshots_dir(),
                cfg.data_dir.join("lazy"),
                store.fetch,
                store.cache_max_bytes,
            ))),
            None => None,
        };
        let network = match &cfg.network {
            Some(n) => Some(Network::open(n.clone(), &cfg.data_dir)?),
            None => None,
        };
        let held = crate::hot::HeldImages::new(cfg.limits.hot_image_mib);
        Ok(Host {
            cfg,
            pool,
            vms: Mutex::new(Vms::default()),
            fetcher,
            network,
            exposed: Mutex::new(HashMap::new()),
            making: Mutex::new(HashSet::new()),
            held,
            cgroups,
            no_cgroups,
            charged: Mutex::new(Charged::default()),
            _lock: lock,
        })
    }

    pub fn config(&self) -> &HostConfig {
        &self.cfg
    }

    /// Start the pool's workers now, and prepare its child networks in the background (the
    /// daemon, at start-up).
    pub fn fill_pool(&self) {
        self.pool.refill();
        // The same background refill as after a spawn, so a drain joins it.
        if let Some(net) = &self.network {
            net.refill_in_background();
        }
    }

    /// The host's child networks, if it has them.
    pub fn network(&self) -> Option<&Arc<Network>> {
        self.network.as_ref()
    }

    /// Forward connections to a port on this host to `guest_port` of VM `id`'s guest; the
    /// same port again gets the same address. Closed when the VM goes.
    pub fn expose_port(&self, id: &SandboxId, guest_port: u16) -> Result<std::net::SocketAddr> {
        const MAX_EXPOSED: usize = 64;
        if guest_port == 0 {
            return Err(HostError::NetworkRefused("guest port 0".into()));
        }
        let net_name = {
            let vms = self.vms();
            let live = vms
                .live
                .get(id)
                .ok_or_else(|| HostError::NoVm(id.clone()))?;
            live.record.net.clone()
        };
        let (Some(net), Some(name)) = (&self.network, net_name) else {
            return Err(HostError::NetworkRefused(format!(
                "sandbox {id} has no network (its executor or its snapshot has none)"
            )));
        };
        let target = net
            .guest_address(&name)
            .ok_or_else(|| HostError::NetworkRefused(format!("{name} is not a child network")))?;
        let mut exposed = self.exposed.lock().unwrap_or_else(|p| p.into_inner());
        let ports = exposed.entry(id.clone()).or_default();
        if let Some(f) = ports.iter().find(|f| f.guest_port() == guest_port) {
            return Ok(f.addr());
        }
        if ports.len() >= MAX_EXPOSED {
            return Err(HostError::NetworkRefused(format!(
                "sandbox {id} has {MAX_EXPOSED} exposed ports already"
            )));
        }
        let bind = net.config().expose_ip;
        let f = crate::network::expose::Forward::open(
            bind,
            std::net::SocketAddrV4::new(target, guest_port),
        )
        .map_err(HostError::io(format!(
            "listening on {bind} for sandbox {id}"
        )))?;
        let addr = f.addr();
        ports.push(f);
        drop(exposed);
        // Killed meanwhile: its forward must not outlive it (never both locks at once).
        if !self.vms().live.contains_key(id) {
            self.exposed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(id);
            return Err(HostError::NoVm(id.clone()));
        }
        tracing::info!(%id, guest_port, %addr, "guest port exposed");
        Ok(addr)
    }

    /// Remove a VM's directory, its exposed ports and its network.
    fn discard(&self, record: &VmRecord) {
        self.exposed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&record.id);
        let _ = std::fs::remove_dir_all(&record.dir);
        if let Some(ns) = &record.net {
            crate::network::remove_recorded(&self.cfg.data_dir.join("net"), ns);
        }
        if let Some(cg) = &self.cgroups {
            cg.remove(&record.cgroup_name());
        }
    }

    /// The name of live child `id`'s cgroup (None: no such child).
    fn cgroup_of(&self, id: &SandboxId) -> Option<CgroupName> {
        self.vms().live.get(id).map(|l| l.record.cgroup_name())
    }

    /// Where live child `id`'s cgroup is (None: no such child, or no cgroups here).
    pub fn cgroup_dir(&self, id: &SandboxId) -> Option<PathBuf> {
        Some(self.cgroups.as_ref()?.dir(&self.cgroup_of(id)?))
    }

    /// The memory limit of the cgroup `name`, if the kernel killed in it for want of memory.
    fn out_of_memory(&self, name: &CgroupName) -> Option<u64> {
        let u = self.cgroups.as_ref()?.usage(name)?;
        (u.oom_kills > 0).then_some(u.memory_max.unwrap_or(0))
    }

    /// The cgroups children run in (None: none, see [`Host::cgroups_refused`]).
    pub fn cgroups(&self) -> Option<&Cgroups> {
        self.cgroups.as_deref()
    }

    /// Why children get no cgroups ("" when they do).
    pub fn cgroups_refused(&self) -> &str {
        &self.no_cgroups
    }

    /// What child `id`'s cgroup counted (None: it runs without one).
    pub fn usage(&self, id: &SandboxId) -> Result<Option<Usage>> {
        let Some(name) = self.cgroup_of(id) else {
            return Err(HostError::NoVm(id.clone()));
        };
        Ok(self.cgroups.as_ref().and_then(|c| c.usage(&name)))
    }

    /// The limits children of a snapshot (its `header`) get for `asked`, or why not.
    fn child_limits(
        &self,
        header: &SnapshotHeader,
        asked: &Resources,
    ) -> Result<Option<ChildLimits>> {
        if self.cgroups.is_none() {
            if asked.asked() {
                return Err(HostError::NoCgroups(self.no_cgroups.clone()));
            }
            return Ok(None);
        }
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
        ChildLimits::for_child(
            header.mem_size >> 20,
            asked.memory_limit_mib,
            asked.cpu_millis,
            cpus,
        )
        .map(Some)
        .map_err(HostError::Limits)
    }

    /// Charge the snapshot in `dir`'s memory files to this host's cgroup before children map
    /// them (once per snapshot), so each child is charged for what it writes.
    fn charge_snapshot(&self, header: &SnapshotHeader, dir: &std::path::Path) {
        if self.cgroups.is_none() {
            return;
        }
        let key = format!("{}:{}", dir.display(), header.state_sha256);
        let charged = || self.charged.lock().unwrap_or_else(|p| p.into_inner());
        if charged().snapshots.contains(&key) {
            return;
        }
        let t = Instant::now();
        match crate::cgroup::charge_snapshot(dir, |f| charged().files.contains(f)) {
            Ok(done) => {
                tracing::info!(snapshot = %dir.display(), mib = done.bytes >> 20, scanned = done.files.len(), already = done.known, took_ms = t.elapsed().as_millis() as u64, "snapshot memory charged to the executor");
                let mut charged = charged();
                charged.files.extend(done.files);
                charged.snapshots.insert(key);
            }
            Err(e) => {
                tracing::warn!(snapshot = %dir.display(), "reading the snapshot's memory ahead of its children: {e}")
            }
        }
    }

    /// Start `n` idle workers now, before a clock starts (a one-shot fork).
    pub fn prestart_workers(&self, n: usize) {
        self.pool.fill_to(n);
    }

    /// [`prestart_workers`](Self::prestart_workers), primed for children of `tag` (a snapshot
    /// of this host's) unless this host does not prime its workers.
    pub fn prestart_workers_for(&self, tag: &Tag, n: usize) -> Result<()> {
        let header = self.snapshot_header(tag)?;
        let snapshot = self.snapshot_dir(tag);
        let image = root_memory(&snapshot, &header)
            .ok()
            .and_then(|m| self.held.get(&m));
        self.prime_pool_for(&snapshot, image);
        self.pool.fill_to(n);
        Ok(())
    }

    /// Idle workers primed for children of `tag`.
    pub fn primed_workers(&self, tag: &Tag) -> usize {
        self.pool.primed(&self.snapshot_dir(tag))
    }

    /// Have the pool prime idle workers for the snapshot in `snapshot` (children mapping
    /// `image` if one is held), if this host primes them.
    fn prime_pool_for(&self, snapshot: &std::path::Path, image: Option<Arc<std::fs::File>>) {
        if !self.cfg.limits.prime_workers {
            return;
        }
        let memory = match image {
            Some(_) => JobMemory::Held,
            None => JobMemory::Image,
        };
        self.pool.set_hot(Some(crate::worker::Hot {
            job: crate::worker::PrimeJob {
                snapshot: snapshot.to_path_buf(),
                memory,
            },
            image,
        }));
    }

    pub fn idle_workers(&self) -> usize {
        self.pool.idle()
    }

    /// Idle workers the pool keeps now: `Limits::pool_size`, or more after bursts found it
    /// short (up to `Limits::pool_max`).
    pub fn pool_target(&self) -> usize {
        self.pool.target()
    }

    /// The process ids of the idle VMM workers, each started and waiting for its job.
    pub fn idle_worker_pids(&self) -> Vec<u32> {
        self.pool.idle_pids()
    }

    fn vms(&self) -> std::sync::MutexGuard<'_, Vms> {
        self.vms.lock().unwrap_or_else(|p| p.into_inner())
    }

    // ---- snapshots ----

    pub fn snapshot_dir(&self, tag: &Tag) -> PathBuf {
        self.cfg.snapshots_dir().join(tag.as_str())
    }

    /// Hold snapshot `tag`'s memory image (for a diff: its root's) in huge pages now, for the
    /// children spawned from it from here on, whatever the hot-image budget (a benchmark's or
    /// an operator's choice; a host holds images on its own after a snapshot's first spawn,
    /// within its budget, where shared memory gets huge pages). Returns the memory it holds.
    pub fn hold_image(&self, tag: &Tag) -> Result<u64> {
        let header = self.snapshot_header(tag)?;
        let memory = root_memory(&self.snapshot_dir(tag), &header)?;
        self.held.hold(&memory).map_err(HostError::io(format!(
            "holding {} in memory",
            memory.display()
        )))
    }

    /// The memory images held now (by the file each copies) and the memory each holds.
    pub fn held_images(&self) -> Vec<(PathBuf, u64)> {
        self.held.held()
    }

    /// The header of a snapshot held here, checked (so a broken one fails the call, not N
    /// children).
    pub fn snapshot_header(&self, tag: &Tag) -> Result<SnapshotHeader> {
        let dir = self.snapshot_dir(tag);
        if !dir.join("snapshot.json").is_file() {
            return Err(HostError::NoSnapshot(tag.clone()));
        }
        header_in(tag, &dir)
    }

    /// Boot an image, warm it, and snapshot it under `spec.tag`. The snapshot appears under
    /// its tag only once complete (written aside, then renamed).
    pub fn create_snapshot(&self, spec: &ParentSpec) -> Result<MadeSnapshot> {
        // A retry that arrives while an earlier attempt (whose caller went away) still runs
        // is told so, rather than booting a second parent that would lose the race to install.
        let _making = Making::claim(&self.making, &spec.tag)?;
        self.create_snapshot_once(spec)
    }

    fn create_snapshot_once(&self, spec: &ParentSpec) -> Result<MadeSnapshot> {
        let dir = self.snapshot_dir(&spec.tag);
        if dir.exists() && !spec.replace {
            return Err(HostError::SnapshotExists(spec.tag.clone()));
        }
        if let Some(child) = self.local_descendants(&spec.tag).first() {
            // Replacing it would leave their diffs over memory that is gone.
            return Err(HostError::HasDescendants {
                tag: spec.tag.clone(),
                child: child.to_string(),
            });
        }
        let id = SandboxId::random(&format!("parent-{}", spec.tag));
        let work = self.cfg.vms_dir().join(id.as_str());
        let staging = self
            .cfg
            .snapshots_dir()
            .join(format!(".partial-{}", id.as_str()));
        std::fs::create_dir_all(&work)
            .map_err(HostError::io(format!("creating {}", work.display())))?;
        let timeout = spec
            .ready_timeout
            .unwrap_or(self.cfg.limits.parent_ready_timeout);
        // The parent gets a network like a child's (the default policy): its warm-up can
        // install packages, and its snapshot has the interface its children will use.
        let lease = match &self.network {
            Some(n) => match n.take(&n.config().default_policy) {
                Ok(l) => Some(l),
                Err(e) => {
                    let _ = std::fs::remove_dir_all(&work);
                    return Err(e);
                }
            },
            None => None,
        };
        if let Some(n) = &self.network {
            n.refill_in_background();
        }
        let made = self.boot_parent(spec, &id, &work, &staging, timeout, lease.as_ref());
        let _ = std::fs::remove_dir_all(&work);
        if let (Some(n), Some(l)) = (&self.network, lease) {
            n.release(l);
        }
        let mut made = match made {
            Ok(m) => m,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&staging);
                return Err(e);
            }
        };
        let installed = (|| {
            // Its children map these pages before they run; a store's hosts get them too.
            let ws = self.record_page_lists(&spec.tag, &staging);
            if let Some(f) = &self.fetcher {
                // A snapshot the other hosts cannot fetch is not made at all.
                let _publishing = f.in_flight();
                f.grew();
                made.layer = Some(f.layers.publish(&spec.tag, &staging, ws)?);
            }
            self.install_snapshot(&staging, &dir, spec.replace, &spec.tag)
        })();
        if let Err(e) = installed {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
        // Charged now, while the call is seconds long anyway, not at its first child's spawn.
        self.charge_snapshot(&made.header, &dir);
        made.dir = dir;
        self.enforce_cache_bound();
        Ok(made)
    }

    /// Have one VMM worker confine itself as it would for a child (its view, /dev/kvm inside
    /// it, its own user, no capabilities, the filter) and exit: a host where that cannot work
    /// (a container without CAP_SYS_ADMIN, a kernel without seccomp) is told once, at start,
    /// rather than failing every spawn. A daemon calls this before it serves.
    pub fn check_confinement(&self) -> Result<()> {
        let id = SandboxId::random("probe");
        let dir = self.cfg.vms_dir().join(id.as_str());
        let snapshots = self.cfg.snapshots_dir();
        for d in [&dir, &snapshots] {
            std::fs::create_dir_all(d)
                .map_err(HostError::io(format!("creating {}", d.display())))?;
        }
        let probed = (|| {
            let worker = self.pool.take()?;
            let pid = worker.pid();
            // Its cgroup (if it waited in one) goes once it is reaped, at the end.
            let (mut vmm, report, _cgroup) =
                worker.run(&self.worker_job(pid, JobVm::Probe { snapshots }, &dir, None))?;
            let reported = crate::ready::wait_restored(&report, Duration::from_secs(30));
            let _ = vmm.kill();
            let _ = vmm.wait();
            match reported? {
                Some(_) => Ok(()),
                None => Err(HostError::Unconfined { log: vmm_log(&dir) }),
            }
        })();
        let _ = std::fs::remove_dir_all(&dir);
        probed
    }

    /// The job for worker `pid`: `vm` in directory `dir`, in network namespace `netns`,
    /// confined as this host confines its VMMs.
    fn worker_job(
        &self,
        pid: u32,
        vm: JobVm,
        dir: &std::path::Path,
        netns: Option<PathBuf>,
    ) -> WorkerJob {
        // Children only: a booting parent's RAM is shared memory, which KSM never merges.
        let merge_pages = self.cfg.limits.merge_pages && matches!(vm, JobVm::Restore { .. });
        let give_back_after_ms = match vm {
            JobVm::Restore { .. } => self.cfg.limits.give_back_after,
            _ => None,
        }
        .map(|d| d.as_millis() as u64);
        WorkerJob {
            vm,
            dir: dir.to_path_buf(),
            netns,
            confine: self.cfg.confine.for_worker(pid),
            merge_pages,
            give_back_after_ms,
            #[cfg(feature = "testing")]
            trip_seccomp: self.cfg.confine.trip_seccomp,
        }
    }

    /// Boot `spec`'s parent in a VMM worker (confined like a child's) in `work`, warm it and
    /// have it write its snapshot into `staging`. The worker is ended on every path.
    fn boot_parent(
        &self,
        spec: &ParentSpec,
        id: &SandboxId,
        work: &std::path::Path,
        staging: &std::path::Path,
        timeout: Duration,
        lease: Option<&crate::network::Lease>,
    ) -> Result<MadeSnapshot> {
        let started = Instant::now();
        let net_cmdline = self.network.as_ref().map(|n| n.config().guest_cmdline());
        let job = crate::parent::boot_job(
            spec,
            &self.cfg.image_cache,
            &self.cfg.snapshots_dir(),
            lease.and(net_cmdline.as_deref()),
        )?;
        let worker = self.pool.take()?;
        let pid = worker.pid();
        // A daemon that dies while the parent boots: the next one kills it (never ready).
        VmRecord {
            id: id.clone(),
            tag: None,
            owner: self.cfg.owner.clone(),
            process: worker
                .identity()
                .map_err(HostError::io(format!("identifying VMM worker {pid}")))?,
            created_unix_ms: now_ms(),
            ready: false,
            pages_from_host: false,
            dir: work.to_path_buf(),
            net: lease.map(|l| l.name()),
            // A parent runs where it waited, with no limits; that cgroup goes once it is
            // reaped, at the end.
            cgroup: worker.cgroup().map(|c| c.name().clone()),
        }
        .write()?;
        let (mut vmm, report, _cgroup) =
            worker.run(&self.worker_job(pid, JobVm::Boot(job), work, lease.map(|l| l.path())))?;
        tracing::info!(tag = %spec.tag, pid, "booting a parent");
        let made = crate::parent::warm_and_snapshot(
            spec, work, staging, timeout, &mut vmm, &report, started,
        );
        let _ = vmm.kill();
        let _ = vmm.wait();
        made
    }

    /// Move a complete snapshot from `staging` to `dir`. Replacing moves the old one aside
    /// first, so spawns see the old or the new snapshot, never none.
    fn install_snapshot(
        &self,
        staging: &std::path::Path,
        dir: &std::path::Path,
        replace: bool,
        tag: &Tag,
    ) -> Result<()> {
        let aside = self
            .cfg
            .snapshots_dir()
            .join(format!(".replaced-{}", SandboxId::random("old").as_str()));
        let replacing = dir.exists();
        if replacing {
            if !replace {
                return Err(HostError::SnapshotExists(tag.clone()));
            }
            std::fs::rename(dir, &aside)
                .map_err(HostError::io(format!("moving {} aside", dir.display())))?;
        }
        if let Err(e) = std::fs::rename(staging, dir) {
            if replacing {
                let _ = std::fs::rename(&aside, dir);
            }
            return Err(match e.kind() {
                // Another create of the same tag won the race.
                std::io::ErrorKind::AlreadyExists | std::io::ErrorKind::DirectoryNotEmpty => {
                    HostError::SnapshotExists(tag.clone())
                }
                _ => HostError::io(format!("moving the snapshot to {}", dir.display()))(e),
            });
        }
        if replacing {
            // Workers primed for the old one would keep its files open, and serve none.
            self.pool.forget(dir);
            let _ = std::fs::remove_dir_all(&aside);
        }
        Ok(())
    }

    /// Push a snapshot held here to the cluster's store as a layer (snapshots made here with a
    /// store configured are pushed as they are made).
    pub fn publish(&self, tag: &Tag) -> Result<crate::layers::LayerInfo> {
        let Some(f) = &self.fetcher else {
            return Err(HostError::Store {
                what: format!("publishing {tag}"),
                reason: "this host has no store configured".into(),
            });
        };
        let header = self.snapshot_header(tag)?;
        let dir = self.snapshot_dir(tag);
        let kept = crate::lazy::load_page_list(
            &dir,
            crate::lazy::WORKING_SET_FILE,
            header.mem_size / 4096,
        );
        let ws = match kept {
            Some(ws) => ws,
            None => self.record_page_lists(tag, &dir),
        };
        let info = {
            let _publishing = f.in_flight();
            f.grew();
            f.layers.publish(tag, &self.snapshot_dir(tag), ws)
        };
        self.enforce_cache_bound();
        info
    }

    /// Snapshot running VM `id` under `tag` and let it run on: a diff over the snapshot it
    /// was forked from (the pages it wrote since) or a complete image. Memory, vCPU and
    /// device state are of one instant; the snapshot appears under `tag` only once complete.
    pub fn branch(
        &self,
        id: &SandboxId,
        tag: &Tag,
        kind: crate::control::BranchKind,
    ) -> Result<Branch> {
        self.branch_then(id, tag, kind, |_| {})
    }

    /// [`branch`](Self::branch), calling `resumed` with the pause as soon as the VM runs
    /// again, before the snapshot is complete (a live branch's pages are still being copied;
    /// any branch may still have its layer to publish).
    pub fn branch_then(
        &self,
        id: &SandboxId,
        tag: &Tag,
        kind: crate::control::BranchKind,
        resumed: impl FnOnce(Resumed),
    ) -> Result<Branch> {
        let t0 = Instant::now();
        let refuse = |reason: String| HostError::Branch {
            id: id.clone(),
            reason,
        };
        let record = {
            let vms = self.vms();
            match vms.live.get(id) {
                Some(l) if l.ready => l.record.clone(),
                Some(_) => {
                    return Err(refuse(
                        "it is still starting: branch it once it is ready".into(),
                    ))
                }
                None if vms.pending.contains_key(id) => {
                    return Err(refuse(
                        "it is still starting: branch it once it is ready".into(),
                    ))
                }
                None => return Err(HostError::NoVm(id.clone())),
            }
        };
        let Some(forked_from) = record.tag.clone() else {
            return Err(refuse("it is a booting parent, not a forked child".into()));
        };
        if record.pages_from_host {
            return Err(refuse(format!(
                "it was restored lazily (its untouched pages are still in the store): branch a child of {forked_from} restored from a local image"
            )));
        }
        let dir = self.snapshot_dir(tag);
        if dir.exists() {
            return Err(HostError::SnapshotExists(tag.clone()));
        }
        // Beside the parent: a diff names its parent as a sibling directory.
        let staging = self.cfg.snapshots_dir().join(format!(
            ".partial-branch-{}",
            SandboxId::random("b").as_str()
        ));
        // Made here and lent to the VMM's user: a confined VMM can create nothing else.
        crate::confine::lend::lend_dir(&staging, record.process.pid)
            .map_err(|e| refuse(format!("preparing {} for its VMM: {e}", staging.display())))?;
        let req = crate::control::Request::Branch {
            dir: staging.clone(),
            kind,
        };
        let mut resumed = Some(resumed);
        let reply = ask_vmm_then(id, &record.dir, &req, |r| {
            if let crate::control::Reply::Resumed { paused_us, parent } = r {
                let parent = parent.as_deref().and_then(|p| Tag::parse(p).ok());
                if let Some(f) = resumed.take() {
                    f(Resumed {
                        paused: Duration::from_micros(*paused_us),
                        parent: parent.unwrap_or_else(|| forked_from.clone()),
                    });
                }
            }
        });
        let done = (|| {
            let (paused_us, pages_written) = match reply? {
                crate::control::Reply::Branched {
                    paused_us,
                    pages_written,
                } => (paused_us, pages_written),
                other => return Err(refuse(format!("unexpected answer {other:?}"))),
            };
            crate::confine::lend::take_back_dir(&staging)
                .map_err(|e| refuse(format!("its VMM's branch in {}: {e}", staging.display())))?;
            let header = tine_vmm::snapshot::file::load_header(&staging).map_err(|source| {
                HostError::BadSnapshot {
                    tag: tag.clone(),
                    source,
                }
            })?;
            let parent = match &header.diff {
                Some(d) => Tag::parse(&d.parent)
                    .map_err(|e| refuse(format!("its VMM named a bad parent: {e}")))?,
                None => forked_from.clone(),
            };
            if let Some(f) = resumed.take() {
                f(Resumed {
                    paused: Duration::from_micros(paused_us),
                    parent: parent.clone(),
                });
            }
            if let Some(d) = &header.diff {
                // The parent here must still be the one the diff was taken over.
                let now = self.snapshot_header(&parent).map_err(|e| {
                    refuse(format!("snapshot {parent}, which it is a diff over: {e}"))
                })?;
                if now.state_sha256 != d.parent_state_sha256 {
                    return Err(refuse(format!(
                        "snapshot {parent} was replaced while the diff over it was taken: take a full branch"
                    )));
                }
            }
            // As for snapshots made here: one the other hosts cannot fetch is not made.
            let layer = match &self.fetcher {
                Some(f) => {
                    let _publishing = f.in_flight();
                    f.grew();
                    Some(match kind {
                        crate::control::BranchKind::Diff | crate::control::BranchKind::Live => {
                            f.layers.publish_diff(tag, &staging, &parent)?
                        }
                        crate::control::BranchKind::Full => {
                            f.layers.publish(tag, &staging, Vec::new())?
                        }
                    })
                }
                None => None,
            };
            self.install_snapshot(&staging, &dir, false, tag)?;
            // A diff in place: the VM's next branch need only hold what changes from here.
            let rebase = match kind {
                crate::control::BranchKind::Full => None,
                _ => self.rebase(id, &record.dir, &dir),
            };
            Ok(Branch {
                layer,
                rebase,
                tag: tag.clone(),
                parent,
                kind,
                dir: dir.clone(),
                header,
                paused: Duration::from_micros(paused_us),
                pages_written,
                took: t0.elapsed(),
            })
        })();
        if done.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        let b = done?;
        tracing::info!(%id, %tag, parent = %b.parent, kind = ?b.kind, pages = b.pages_written, paused_us = b.paused.as_micros() as u64, took_ms = b.took.as_millis() as u64, "branched");
        Ok(b)
    }

    /// Take the diff branch in `snapshot` as VM `id`'s new diff base. A failure only costs
    /// the next branch's size, so it is logged, not returned.
    fn rebase(
        &self,
        id: &SandboxId,
        vm_dir: &std::path::Path,
        snapshot: &std::path::Path,
    ) -> Option<Rebase> {
        let req = crate::control::Request::Rebase {
            dir: snapshot.to_path_buf(),
        };
        match ask_vmm(id, vm_dir, &req) {
            Ok(crate::control::Reply::Rebased {
                paused_us,
                pages_mapped,
                pages_kept,
            }) => Some(Rebase {
                paused: Duration::from_micros(paused_us),
                counts: tine_vmm::memory::Rebased {
                    pages_mapped,
                    pages_kept,
                },
            }),
            Ok(other) => {
                tracing::warn!(%id, "rebase: unexpected answer {other:?}");
                None
            }
            Err(e) => {
                tracing::warn!(%id, "not rebased onto its branch (its next branch holds more): {e}");
                None
            }
        }
    }

    /// Pause VM `id` and resume it at once; how long it was paused (a branch's floor).
    pub fn pause_resume(&self, id: &SandboxId) -> Result<Duration> {
        let dir = self.vm_dir(id)?;
        let refuse = |reason: String| HostError::Branch {
            id: id.clone(),
            reason,
        };
        match ask_vmm(id, &dir, &crate::control::Request::PauseResume)? {
            crate::control::Reply::Paused { paused_us } => Ok(Duration::from_micros(paused_us)),
            other => Err(refuse(format!("unexpected answer {other:?}"))),
        }
    }

    /// KVM's counters for VM `id` so far: exits by reason, page faults, halts (None: this
    /// host's KVM keeps none).
    pub fn kvm_counters(&self, id: &SandboxId) -> Result<Option<Counters>> {
        let dir = self.vm_dir(id)?;
        let refuse = |reason: String| HostError::Counters {
            id: id.clone(),
            reason,
        };
        let req = crate::control::Request::KvmCounters;
        match crate::control::request(&dir, &req, Duration::from_secs(10))
            .map_err(|e| refuse(format!("its VMM did not answer: {e}")))?
        {
            crate::control::Reply::KvmCounters { counters } => Ok(counters),
            other => Err(refuse(format!("unexpected answer {other:?}"))),
        }
    }

    /// Snapshots here whose diff applies over `tag`.
    fn local_descendants(&self, tag: &Tag) -> Vec<Tag> {
        self.diff_parents()
            .into_iter()
            .filter(|(_, parent)| parent == tag)
            .map(|(child, _)| child)
            .collect()
    }

    /// (diff, the snapshot it applies over) for every diff snapshot here.
    fn diff_parents(&self) -> Vec<(Tag, Tag)> {
        self.snapshot_tags()
            .into_iter()
            .filter_map(|t| {
                let h = tine_vmm::snapshot::file::load_header(&self.snapshot_dir(&t)).ok()?;
                let parent = Tag::parse(h.diff?.parent).ok()?;
                Some((t, parent))
            })
            .collect()
    }

    /// Forget a snapshot here. Running children keep their mapping of its memory image.
    /// Refused while a diff here applies over it.
    pub fn delete_snapshot(&self, tag: &Tag) -> Result<bool> {
        if let Some(child) = self.local_descendants(tag).first() {
            return Err(HostError::HasDescendants {
                tag: tag.clone(),
                child: child.to_string(),
            });
        }
        let dir = self.snapshot_dir(tag);
        self.held.forget(&dir.join(MEMORY_FILE));
        let existed = dir.exists();
        let removed = if existed {
            std::fs::remove_dir_all(&dir)
        } else {
            Ok(())
        };
        // Workers primed for it would keep its files open. After the removal, so workers
        // priming for it meanwhile find their files gone (`WorkerPool::prime_idle`).
        self.pool.forget(&dir);
        removed.map_err(HostError::io(format!("removing {}", dir.display())))?;
        if let Some(f) = &self.fetcher {
            // Its layers go with the next garbage collection, once no other chain uses them.
            f.layers.forget(tag)?;
        }
        Ok(existed)
    }

    /// Collect the layers of deleted snapshots (older than the store's grace period) in the
    /// store and in this host's cache. None: this host has no store.
    pub fn collect_garbage(&self) -> Result<Option<crate::layers::Collected>> {
        let Some(f) = &self.fetcher else {
            return Ok(None);
        };
        let c = f.layers.collect_garbage()?;
        tracing::info!(
            store_layers = c.store.layers_deleted,
            store_objects = c.store.objects_deleted,
            store_bytes = c.store.bytes_deleted,
            cache_layers = c.cache.layers_deleted,
            cache_objects = c.cache.objects_deleted,
            images = c.images,
            "garbage collected"
        );
        Ok(Some(c))
    }

    /// Tags of the complete snapshots held here.
    pub fn snapshot_tags(&self) -> Vec<Tag> {
        let Ok(entries) = std::fs::read_dir(self.cfg.snapshots_dir()) else {
            return Vec::new();
        };
        let mut tags: Vec<Tag> = entries
            .flatten()
            .filter(|e| e.path().join("snapshot.json").is_file())
            .filter_map(|e| e.file_name().into_string().ok())
            .filter_map(|n| Tag::parse(n).ok())
            .collect();
        tags.sort();
        tags
    }

    // ---- spawning ----

    /// Restore one child per id from snapshot `tag`; `report` is called (from several
    /// threads) as each becomes ready or fails. Children past the host's capacity fail with
    /// [`HostError::Full`]. Errors that concern the whole call (unknown or broken snapshot)
    /// are returned before any child starts.
    pub fn spawn(
        &self,
        tag: &Tag,
        ids: Vec<SandboxId>,
        opts: &SpawnOptions,
        report: impl Fn(SpawnOutcome) + Sync,
    ) -> Result<()> {
        let result = {
            let _spawning = self.fetcher.as_ref().map(|f| f.in_flight());
            // The pool's refill waits for it: workers started meanwhile would compete with
            // its children for the CPU.
            let _burst = self.pool.spawning();
            self.spawn_in_flight(tag, ids, opts, report)
        };
        self.enforce_cache_bound();
        result
    }

    /// Trim the layer cache to its bound, sparing snapshots children here run from.
    pub fn enforce_cache_bound(&self) {
        if let Some(f) = &self.fetcher {
            let mut live: std::collections::HashSet<Tag> = self
                .vms()
                .live
                .values()
                .filter_map(|l| l.record.tag.clone())
                .collect();
            // A diff here maps its parent's image: that image stays while the diff does.
            live.extend(self.diff_parents().into_iter().map(|(_, parent)| parent));
            for dir in f.enforce_bound(&live) {
                // Fetched again when next asked for, as new files: what was held or primed
                // for the removed ones would serve none and keep them open.
                self.held.forget(&dir.join(MEMORY_FILE));
                self.pool.forget(&dir);
            }
        }
    }

    fn spawn_in_flight(
        &self,
        tag: &Tag,
        ids: Vec<SandboxId>,
        opts: &SpawnOptions,
        report: impl Fn(SpawnOutcome) + Sync,
    ) -> Result<()> {
        let source = match (&opts.layer, &self.fetcher) {
            (Some(head), Some(f)) => f.source(tag, head, opts.fetch)?,
            (Some(_), None) if !self.has_snapshot(tag) => {
                return Err(HostError::NoSnapshot(tag.clone()))
            }
            _ => Source::Local,
        };
        let (lazy, header) = match source {
            Source::Lazy(img) => {
                let header = header_in(tag, &img.dir)?;
                (Some(img), header)
            }
            Source::Local => (None, self.snapshot_header(tag)?),
        };
        let snapshot = match &lazy {
            Some(img) => img.dir.clone(),
            None => self.snapshot_dir(tag),
        };
        let pages: Option<Arc<dyn Pages>> = lazy.clone().map(|i| i as Arc<dyn Pages>);
        // A snapshot of this host's: its children may map a copy of its root's image held in
        // huge pages.
        let memory = match lazy {
            None => root_memory(&snapshot, &header).ok(),
            Some(_) => None,
        };
        let image = memory.as_deref().and_then(|m| self.held.get(m));
        let policy = self.spawn_policy(tag, &header, opts.network.as_ref())?;
        let limits = self.child_limits(&header, &opts.resources)?;
        if lazy.is_none() {
            // Its next children find workers made ready for it.
            self.prime_pool_for(&snapshot, image.clone());
            self.charge_snapshot(&header, &snapshot);
        }
        let timeout = opts.ready_timeout.unwrap_or(self.cfg.limits.ready_timeout);
        let readiness = opts.readiness.unwrap_or(self.cfg.readiness);
        // Accepted now, so a kill that arrives while a child waits its turn cancels it.
        let mut accepted = Vec::with_capacity(ids.len());
        {
            let mut vms = self.vms();
            for id in ids {
                let taken = vms.live.contains_key(&id) || vms.pending.contains_key(&id);
                if !taken {
                    vms.pending.insert(id.clone(), false);
                }
                accepted.push((id, taken));
            }
        }
        let ids = accepted;
        let n = ids.len();
        let width = match opts.parallel {
            0 => n,
            p => p.min(n),
        }
        .min(MAX_CONCURRENT_SPAWNS);
        let queue = Mutex::new(ids.into_iter());
        // Each child's spans belong to the caller's trace (e.g. the control plane's Spawn).
        let parent = tracing::Span::current();
        std::thread::scope(|s| {
            for _ in 0..width {
                s.spawn(|| loop {
                    let _in = parent.enter();
                    let Some(id) = queue.lock().unwrap_or_else(|p| p.into_inner()).next() else {
                        return;
                    };
                    let (id, taken) = id;
                    report(if taken {
                        SpawnOutcome {
                            pid: None,
                            result: Err(HostError::VmExists(id.clone())),
                            id,
                            lazy: None,
                        }
                    } else {
                        self.spawn_one(
                            &ChildPlan {
                                tag,
                                snapshot: &snapshot,
                                readiness,
                                timeout,
                                lazy: pages.as_ref(),
                                image: image.as_ref(),
                                policy: policy.as_ref(),
                                limits: limits.as_ref(),
                                give_back: true,
                            },
                            id,
                        )
                    });
                });
            }
        });
        if let (Some(img), Some(f)) = (&lazy, &self.fetcher) {
            // Its first children run: fetch the whole image now, for the ones to come.
            f.fill_in_background(tag, &img.head);
        }
        if let (Some(net), Some(_)) = (&self.network, &policy) {
            net.refill_in_background();
        }
        if let (Some(m), None) = (&memory, &image) {
            // Its first children run: hold its memory for the ones to come.
            self.held.hold_in_background(m);
        }
        Ok(())
    }

    /// The policy children of snapshot `tag` (its `header`) get: `asked`, or the host's
    /// default; None when they get no network (the host has none, or the guest no interface).
    fn spawn_policy(
        &self,
        tag: &Tag,
        header: &SnapshotHeader,
        asked: Option<&Policy>,
    ) -> Result<Option<Policy>> {
        match (&self.network, header.network, asked) {
            (Some(net), true, asked) => {
                Ok(Some(asked.unwrap_or(&net.config().default_policy).clone()))
            }
            (None, _, Some(_)) => Err(HostError::NetworkRefused(
                "this executor runs without child networks (start it with networking on)".into(),
            )),
            (Some(_), false, Some(_)) => Err(HostError::NetworkRefused(format!(
                "snapshot {tag} was made without a network interface: make it again on a host \
                 with networking to give its children one"
            ))),
            _ => Ok(None),
        }
    }

    /// Check that children of `tag` (head `layer`) can be spawned here, fetching what this
    /// host's mode fetches up front (eager: the image; lazy: the manifests and VM state), so a
    /// missing, unfetchable or broken snapshot fails a whole spawn call before any child.
    /// Children asking for `network` are checked too (a host without networking, or a
    /// snapshot without an interface, refuses them here).
    pub fn prepare_spawn(&self, tag: &Tag, opts: &SpawnOptions) -> Result<()> {
        let lazy = match (&opts.layer, &self.fetcher) {
            (Some(head), Some(f)) => match f.source(tag, head, None)? {
                Source::Lazy(img) => Some(img),
                Source::Local => None,
            },
            _ => None,
        };
        let header = match &lazy {
            Some(img) => header_in(tag, &img.dir)?,
            None => self.snapshot_header(tag)?,
        };
        self.spawn_policy(tag, &header, opts.network.as_ref())?;
        self.child_limits(&header, &opts.resources)?;
        Ok(())
    }

    /// Restore one child of the snapshot in `dir` with its pages served from the image there,
    /// record the pages it touches until it is ready (the working set a cold host fetches
    /// first), and kill it. Best effort: on failure the snapshot goes without one.
    fn record_working_set(&self, tag: &Tag, dir: &std::path::Path) -> Vec<u64> {
        let t0 = Instant::now();
        let img = match FileImage::open(tag, dir) {
            Ok(i) => i,
            Err(e) => {
                tracing::warn!(%tag, "no working set recorded: {e}");
                return Vec::new();
            }
        };
        let pages: Arc<dyn Pages> = img.clone();
        // Recorded on after readiness for as long again as it took (within bounds): work the
        // guest had due as it resumed (timers long expired, a connection left closing in the
        // snapshot) runs before a child's Wake at full pace, but can fall after it in this
        // child, whose every first touch waits for the page server; unrecorded, each such
        // page costs every child a nested page fault on its way to ready.
        let out = self.recording_child(tag, dir, Some(&pages), |_| {
            std::thread::sleep(t0.elapsed().clamp(RECORD_PAST_READY.0, RECORD_PAST_READY.1))
        });
        match out {
            Ok(_) => {
                // The page server hands the list over as the VMM's exit ends it.
                let deadline = Instant::now() + Duration::from_secs(5);
                let ws = loop {
                    match img.take_recorded() {
                        Some(ws) => break ws,
                        None if Instant::now() >= deadline => break Vec::new(),
                        None => std::thread::sleep(Duration::from_millis(5)),
                    }
                };
                tracing::info!(%tag, pages = ws.len(), took_ms = t0.elapsed().as_millis() as u64, "working set recorded");
                ws
            }
            Err(e) => {
                tracing::warn!(%tag, "no working set recorded: {e}");
                Vec::new()
            }
        }
    }

    /// Record the page lists of the snapshot in `dir` and keep them beside it: its working set
    /// (returned), and which of those pages a child writes on its way to ready: the pages two
    /// children, restored as any other one after the other, both hold as private copies as soon
    /// as they are ready (read from their page maps). One child alone also writes pages that
    /// timing decides (a timer that fired, a slab object taken), which other children would
    /// not write but would all be given; a page both wrote is one nearly every child writes.
    /// Both lists are hints its children's workers map ahead (see [`tine_vmm::prefault`]);
    /// without them children only fault as before, so what cannot be had is only logged.
    /// Two more children, mapped ahead with both lists, then complete them with what children
    /// at that pace write ([`Self::complete_page_lists`]).
    fn record_page_lists(&self, tag: &Tag, dir: &std::path::Path) -> Vec<u64> {
        use crate::lazy::{save_page_list, WORKING_SET_FILE, WRITTEN_SET_FILE};
        let mut ws = self.record_working_set(tag, dir);
        if ws.is_empty() {
            return ws;
        }
        let t0 = Instant::now();
        let written = self.written_by_two_children(tag, dir);
        let kept = save_page_list(dir, WORKING_SET_FILE, &ws).and_then(|()| match written {
            Ok(w) => {
                tracing::info!(%tag, pages = w.len(), took_ms = t0.elapsed().as_millis() as u64, "written set recorded");
                save_page_list(dir, WRITTEN_SET_FILE, &w)?;
                self.complete_page_lists(tag, dir, &mut ws, w)
            }
            Err(e) => {
                tracing::warn!(%tag, "no written set recorded: {e}");
                Ok(())
            }
        });
        if let Err(e) = kept {
            // Only hints: the snapshot is whole without them.
            tracing::warn!(%tag, "keeping the page lists beside the snapshot: {e}");
        }
        ws
    }

    /// The pages two children both write (sorted), see [`Self::record_page_lists`].
    fn written_by_two_children(
        &self,
        tag: &Tag,
        dir: &std::path::Path,
    ) -> std::result::Result<Vec<u64>, String> {
        let first = self.written_by_one_child(tag, dir)?;
        let second = self.written_by_one_child(tag, dir)?;
        // Both sorted: keep what the first also wrote.
        Ok(second
            .into_iter()
            .filter(|p| first.binary_search(p).is_ok())
            .collect())
    }

    /// With the lists in place, two more children, now mapped ahead as every later one is,
    /// so they run at the pace later children run at. Which free page the guest's allocator
    /// hands out, or when deferred work runs, depends on that pace: the children recorded
    /// before (the first one served a page per fault, the next two with nothing mapped ahead)
    /// write some pages that children at full pace do not, and these write others. The
    /// pages both write beyond the written set join it and the working set, so later children
    /// find them mapped (each was a read fault, a write fault and its retry).
    fn complete_page_lists(
        &self,
        tag: &Tag,
        dir: &std::path::Path,
        ws: &mut Vec<u64>,
        mut written: Vec<u64>,
    ) -> Result<()> {
        use crate::lazy::{save_page_list, WORKING_SET_FILE, WRITTEN_SET_FILE};
        let t0 = Instant::now();
        let again = match self.written_by_two_children(tag, dir) {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(%tag, "written set not completed at full pace: {e}");
                return Ok(());
            }
        };
        let added = add_written_at_full_pace(ws, &mut written, again);
        tracing::info!(%tag, added, took_ms = t0.elapsed().as_millis() as u64, "written set completed at full pace");
        if added == 0 {
            return Ok(());
        }
        save_page_list(dir, WORKING_SET_FILE, ws)?;
        save_page_list(dir, WRITTEN_SET_FILE, &written)
    }

    /// Restore one child of the snapshot in `dir` and, once it is ready, the image pages it
    /// holds as private copies (sorted).
    fn written_by_one_child(
        &self,
        tag: &Tag,
        dir: &std::path::Path,
    ) -> std::result::Result<Vec<u64>, String> {
        let image = dir.join(tine_vmm::snapshot::file::MEMORY_FILE);
        let written = self.recording_child(tag, dir, None, |pid| match pid {
            Some(pid) => crate::pagemap::written_pages(pid, &image).map_err(|e| e.to_string()),
            None => Err("no VMM process".into()),
        });
        written.map_err(|e| e.to_string())?
    }

    /// Restore one child of the snapshot in `dir` (`lazy`: its pages served from there), call
    /// `ready` on it once it is ready, and kill it.
    fn recording_child<T>(
        &self,
        tag: &Tag,
        dir: &std::path::Path,
        lazy: Option<&Arc<dyn Pages>>,
        ready: impl FnOnce(Option<u32>) -> T,
    ) -> Result<T> {
        let id = SandboxId::random("ws");
        self.vms().pending.insert(id.clone(), false);
        let plan = ChildPlan {
            tag,
            snapshot: dir,
            readiness: self.cfg.readiness,
            timeout: self.cfg.limits.ready_timeout,
            lazy,
            image: None,
            policy: None,
            limits: None,
            give_back: false,
        };
        let out = self.spawn_one(&plan, id.clone());
        let got = out.result.map(|_| ready(out.pid));
        let _ = self.kill(&id);
        got
    }

    fn has_snapshot(&self, tag: &Tag) -> bool {
        self.snapshot_dir(tag).join("snapshot.json").is_file()
    }

    /// Make sure snapshot `tag` is on this host: if not, fetch the layers of `head` it lacks
    /// from the store and set the snapshot up from them. Returns what was fetched (None: the
    /// snapshot was here already).
    pub fn ensure_local(
        &self,
        tag: &Tag,
        head: &tine_snapshot_store::Digest,
    ) -> Result<Option<Fetched>> {
        match &self.fetcher {
            Some(f) => f.ensure_local(tag, head),
            None if self.has_snapshot(tag) => Ok(None),
            None => Err(HostError::NoSnapshot(tag.clone())),
        }
    }

    /// Reserve a slot under `max_vms` for a pending child, counting children still being
    /// handed to a worker; fails if the child was cancelled meanwhile.
    fn reserve(&self, id: &SandboxId) -> Result<()> {
        let max = self.cfg.limits.max_vms as usize;
        let mut vms = self.vms();
        if vms.pending.get(id) == Some(&true) {
            vms.pending.remove(id);
            return Err(HostError::Cancelled(id.clone()));
        }
        let used = vms.live.len() + vms.starting;
        if used >= max {
            vms.pending.remove(id);
            return Err(HostError::Full {
                running: used.min(max) as u32,
                max: max as u32,
            });
        }
        vms.starting += 1;
        Ok(())
    }

    fn spawn_one(&self, plan: &ChildPlan<'_>, id: SandboxId) -> SpawnOutcome {
        let ChildPlan {
            tag,
            readiness,
            timeout,
            lazy,
            image,
            ..
        } = *plan;
        let t = Instant::now();
        let span = tracing::info_span!("spawn.child", id = %id, tag = %tag);
        let _in = span.enter();
        let fail = |id, pid, e| SpawnOutcome {
            id,
            pid,
            result: Err(e),
            lazy: None,
        };
        if let Err(e) = self.reserve(&id) {
            return fail(id, None, e);
        }
        let memory = match (lazy, image) {
            (Some(_), _) => Memory::Lazy,
            (None, Some(image)) => Memory::Held(image),
            (None, None) => Memory::Image,
        };
        let handed = self.hand_off(plan, &id, memory);
        let (pid, restored_pipe, process, network) = match handed {
            Ok(x) => x,
            Err(e) => return fail(id, None, e),
        };
        let pages = match lazy {
            Some(img) => match self.serve_pages(img, pid, &restored_pipe, timeout, &id) {
                Ok(p) => Some(p),
                Err(e) => {
                    let _ = self.kill(&id);
                    return fail(id, Some(pid), e);
                }
            },
            None => None,
        };
        let mut phases = SpawnPhases {
            network,
            handoff: t.elapsed().saturating_sub(network),
            ..SpawnPhases::default()
        };
        let result = make_ready(
            &self.cfg.vms_dir().join(id.as_str()),
            &process,
            restored_pipe,
            readiness,
            timeout,
            &mut phases,
        );
        // A child whose pages stopped coming was killed for it: say why, not "VMM exited".
        let result = match (result, &pages) {
            (Err(e), Some(p)) => Err(p
                .failure
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take()
                .unwrap_or(e)),
            (r, _) => r,
        };
        // One the kernel killed for its memory limit: say so.
        let result =
            result.map_err(
                |e| match self.cgroup_of(&id).and_then(|c| self.out_of_memory(&c)) {
                    Some(limit) => HostError::OutOfMemory {
                        id: id.clone(),
                        limit_mib: limit >> 20,
                    },
                    None => e,
                },
            );
        let mut vms = self.vms();
        let Some(live) = vms.live.get_mut(&id) else {
            // Killed while it was being made ready.
            return fail(id.clone(), Some(pid), HostError::Cancelled(id));
        };
        match result {
            Ok(()) => {
                live.ready = true;
                live.record.ready = true;
                // Not fsynced: after a crash a record that still says "not ready" only makes
                // the next daemon kill the child instead of adopting it.
                if let Err(e) = live.record.write_unsynced() {
                    tracing::warn!(%id, "recording readiness: {e}");
                }
                drop(vms);
                phases.total = t.elapsed();
                let lazy = lazy.zip(pages).map(|(img, p)| finish_recording(img, &p));
                SpawnOutcome {
                    id,
                    pid: Some(pid),
                    result: Ok(phases),
                    lazy,
                }
            }
            Err(e) => {
                drop(vms);
                let _ = self.kill(&id);
                fail(id, Some(pid), e)
            }
        }
    }

    /// Create the child's directory and record, hand a worker the snapshot, and make the
    /// child live (or kill it at once if it was cancelled meanwhile). Releases the slot
    /// `reserve` took.
    fn hand_off(
        &self,
        plan: &ChildPlan<'_>,
        id: &SandboxId,
        memory: Memory<'_>,
    ) -> Result<(u32, std::fs::File, ProcessIdentity, Duration)> {
        let _s = tracing::info_span!("spawn.handoff").entered();
        let started = self.start_worker(plan, id, memory);
        let mut vms = self.vms();
        vms.starting -= 1;
        let cancelled = vms.pending.remove(id) == Some(true);
        let (record, mut child, restored, network) = started?;
        if cancelled {
            drop(vms);
            let _ = child.kill();
            let _ = child.wait();
            self.discard(&record);
            return Err(HostError::Cancelled(id.clone()));
        }
        let (pid, process) = (record.process.pid, record.process.clone());
        vms.live.insert(
            id.clone(),
            Live {
                record,
                child: Some(child),
                ready: false,
            },
        );
        Ok((pid, restored, process, network))
    }

    /// The child's directory and record, and a worker running the job; nothing is left
    /// behind on failure.
    fn start_worker(
        &self,
        plan: &ChildPlan<'_>,
        id: &SandboxId,
        memory: Memory<'_>,
    ) -> Result<(VmRecord, VmmProcess, std::fs::File, Duration)> {
        let &ChildPlan {
            tag,
            snapshot,
            policy,
            limits,
            give_back,
            ..
        } = plan;
        let dir = self.cfg.vms_dir().join(id.as_str());
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                return Err(HostError::VmExists(id.clone()))
            }
            Err(e) => return Err(HostError::io(format!("creating {}", dir.display()))(e)),
        }
        let mut lease = None;
        let mut network = Duration::ZERO;
        // The child's cgroup once it is its own: removed here if the start fails after.
        let mut cgroup = None;
        let started = (|| {
            if let (Some(net), Some(policy)) = (&self.network, policy) {
                let _s = tracing::info_span!("spawn.network").entered();
                let t = Instant::now();
                lease = Some(net.take(policy)?);
                network = t.elapsed();
            }
            // Dropping the worker on any error below kills and reaps it (and then removes
            // the cgroup it waited in).
            let worker = self.pool.take_for(Some(snapshot))?;
            let pid = worker.pid();
            // It has the held image already, if the snapshot's children map one.
            let primed = worker.primed_for(snapshot);
            let record = VmRecord {
                id: id.clone(),
                tag: Some(tag.clone()),
                owner: self.cfg.owner.clone(),
                process: worker
                    .identity()
                    .map_err(HostError::io(format!("identifying VMM worker {pid}")))?,
                created_unix_ms: now_ms(),
                ready: false,
                pages_from_host: matches!(memory, Memory::Lazy),
                dir: dir.clone(),
                net: lease.as_ref().map(|l| l.name()),
                // Where it waited, else one made for it below (if it gets limits).
                cgroup: match (&self.cgroups, worker.cgroup(), limits) {
                    (Some(_), Some(idle), _) => Some(idle.name().clone()),
                    (Some(_), None, Some(_)) => Some(CgroupName::of(id)),
                    _ => None,
                },
            };
            // Recorded before the job is handed over: a daemon that dies now still knows it.
            // Not fsynced: it names processes of this boot (its boot id says so), which a
            // crash that loses the page cache ends too; a record lost with them is a leftover
            // directory, swept at the next start.
            record.write_unsynced()?;
            // Held to its limits before the job: a worker that waited in a cgroup of its own
            // (charged for what it mapped meanwhile) keeps it as the child's; any other is
            // moved into a new one before it touches the snapshot.
            if let (Some(cg), Some(limits)) = (&self.cgroups, limits) {
                match worker.cgroup() {
                    Some(idle) => cg.limit(idle, limits),
                    None => cg.attach(id, limits, pid).map(|name| cgroup = Some(name)),
                }
                .map_err(|e| HostError::Cgroup(e.to_string()))?;
            }
            let mut job = self.worker_job(
                pid,
                JobVm::Restore {
                    snapshot: snapshot.to_path_buf(),
                    memory: memory.job(),
                },
                &dir,
                lease.as_ref().map(|l| l.path()),
            );
            if !give_back {
                job.give_back_after_ms = None;
            }
            let (mut child, restored, waited_in) = worker.run(&job)?;
            if let Some(c) = waited_in {
                cgroup = Some(c.keep());
            }
            if let (Memory::Held(image), false) = (memory, primed) {
                use std::os::fd::AsFd;
                if let Err(e) = crate::handoff::send_image(restored.as_fd(), image.as_fd()) {
                    let _ = child.kill();
                    let _ = child.wait();
                    return Err(HostError::io(
                        "handing the held memory image to a VMM worker",
                    )(e));
                }
            }
            Ok((record, child, restored, network))
        })();
        if started.is_err() {
            let _ = std::fs::remove_dir_all(&dir);
            if let (Some(net), Some(l)) = (&self.network, lease) {
                net.release(l);
            }
            // One made for it removes itself when it cannot be set up; one it waited in
            // goes with its worker until the job was handed over, and here after that.
            if let (Some(cg), Some(name)) = (&self.cgroups, cgroup) {
                cg.remove(&name);
            }
        }
        started
    }

    /// Take a lazily restored child's guest RAM from its worker and serve its pages from a
    /// thread of ours until it exits.
    fn serve_pages(
        &self,
        img: &Arc<dyn Pages>,
        pid: u32,
        sock: &std::fs::File,
        timeout: Duration,
        id: &SandboxId,
    ) -> Result<Arc<ChildPages>> {
        use std::os::fd::AsFd;
        let dir = self.cfg.vms_dir().join(id.as_str());
        let (uffd, ranges) = crate::handoff::recv(sock.as_fd(), timeout)
            .map_err(HostError::io("taking the child's guest RAM"))?
            .ok_or_else(|| HostError::RestoreFailed { log: vmm_log(&dir) })?;
        let pidfd =
            crate::lazy::pidfd_open(pid).map_err(HostError::io(format!("watching VMM {pid}")))?;
        let pages = Arc::new(ChildPages::default());
        if img.claim_recording() {
            *pages.recorded.lock().unwrap_or_else(|p| p.into_inner()) = Some(Vec::new());
        }
        let (img, served) = (img.clone(), pages.clone());
        std::thread::Builder::new()
            .name(format!("tine-pages-{pid}"))
            .spawn(move || crate::lazy::serve(img, uffd, ranges, pidfd, served))
            .map_err(HostError::io("starting the page server"))?;
        Ok(pages)
    }

    // ---- the VMs ----

    /// Ids of the VMs this host runs (its own and adopted ones).
    pub fn live_ids(&self) -> Vec<SandboxId> {
        let mut ids: Vec<SandboxId> = self.vms().live.keys().cloned().collect();
        ids.sort();
        ids
    }

    /// The directory of a VM this host runs.
    pub fn vm_dir(&self, id: &SandboxId) -> Result<PathBuf> {
        self.vms()
            .live
            .get(id)
            .map(|l| l.record.dir.clone())
            .ok_or_else(|| HostError::NoVm(id.clone()))
    }

    /// Every VM recorded in the data directory, whoever owns it.
    pub fn list(&self) -> Vec<VmInfo> {
        records::list(&self.cfg.vms_dir())
            .into_iter()
            .map(|record| VmInfo {
                liveness: record.liveness(),
                record,
            })
            .collect()
    }

    /// Kill a VM this host runs and remove its directory, or cancel a child a spawn accepted
    /// but has not started yet. Returns false if the id is neither.
    pub fn kill(&self, id: &SandboxId) -> Result<bool> {
        let mut vms = self.vms();
        let Some(mut l) = vms.live.remove(id) else {
            return Ok(match vms.pending.get_mut(id) {
                Some(cancelled) => {
                    *cancelled = true;
                    true
                }
                None => false,
            });
        };
        drop(vms);
        match l.child.as_mut() {
            Some(c) => {
                let _ = c.kill();
                let _ = c.wait();
            }
            None => {
                if let Err(e) = l.record.process.kill() {
                    // Still running as far as we know: keep tracking it.
                    self.vms().live.insert(id.clone(), l);
                    return Err(HostError::io(format!("killing VM {id}"))(e));
                }
            }
        }
        self.discard(&l.record);
        tracing::debug!(%id, "VM killed");
        Ok(true)
    }

    /// Kill a recorded VM by id from outside its owner's process (the CLI): only VMs this
    /// host's owner started; the daemon's VMs are the daemon's to stop.
    pub fn kill_recorded(&self, id: &SandboxId) -> Result<()> {
        if self.kill(id)? {
            return Ok(());
        }
        let dir = self.cfg.vms_dir().join(id.as_str());
        let record = VmRecord::read(&dir).ok_or_else(|| HostError::NoVm(id.clone()))?;
        let running = record.liveness() == Liveness::Running;
        if record.owner != self.cfg.owner && running {
            return Err(HostError::NotOwner {
                id: id.clone(),
                owner: record.owner,
            });
        }
        // A record names the process; only a VMM worker is signalled.
        if running && record.process.runs(WORKER_SUBCOMMAND) {
            record
                .process
                .kill()
                .map_err(HostError::io(format!("killing VM {id}")))?;
        }
        std::fs::remove_dir_all(&dir)
            .map_err(HostError::io(format!("removing {}", dir.display())))?;
        self.discard(&record);
        Ok(())
    }

    /// Kill every VM this host runs (and cancel children not started yet).
    pub fn kill_all(&self) {
        let ids: Vec<SandboxId> = {
            let vms = self.vms();
            vms.live.keys().chain(vms.pending.keys()).cloned().collect()
        };
        for id in ids {
            let _ = self.kill(&id);
        }
    }

    /// Forget ready VMs whose VMM exited, reaping our own processes; returns each with its
    /// reason and the tail of its vmm.log. Children not ready yet belong to their spawn.
    pub fn reap(&self) -> Vec<Ended> {
        // Run every second by a daemon: pools grown for bursts go back to their floors once
        // they stop.
        self.pool.shrink_if_quiet();
        if let Some(net) = &self.network {
            net.shrink_if_quiet();
        }
        let mut gone = Vec::new();
        self.vms().live.retain(|id, l| {
            if !l.ready {
                return true;
            }
            let exited = match l.child.as_mut() {
                Some(c) => match c.try_wait() {
                    Ok(Some(status)) => Some(format!("{status}")),
                    _ => None,
                },
                None => (l.record.liveness() != Liveness::Running).then(|| "exited".to_string()),
            };
            match exited {
                Some(how) => {
                    gone.push((id.clone(), l.record.clone(), how));
                    false
                }
                None => true,
            }
        });
        gone.into_iter()
            .map(|(id, record, how)| {
                let tail = vmm_log(&record.dir);
                let oom = self.out_of_memory(&record.cgroup_name());
                self.discard(&record);
                match oom {
                    Some(limit) => {
                        tracing::warn!(%id, limit_mib = limit >> 20, "VM killed: out of memory");
                        Ended {
                            reason: format!(
                                "out of memory: its VMM was killed at its limit of {} MiB",
                                limit >> 20
                            ),
                            id,
                            out_of_memory: true,
                        }
                    }
                    None => {
                        tracing::warn!(%id, %how, vmm_log = %tail, "VMM exited");
                        Ended {
                            id,
                            reason: format!("{how}: {tail}"),
                            out_of_memory: false,
                        }
                    }
                }
            })
            .collect()
    }

    /// After a restart: take back this owner's ready VMs that still run; kill the ones a
    /// previous daemon died while making ready (their clock and RNG were never made their
    /// own); clear records of ones that are gone. A record whose pid now belongs to another
    /// process, or to anything but a VMM worker, is neither adopted nor signalled.
    fn adopt_survivors(&self) {
        self.sweep_leftovers();
        let mut vms = self.vms();
        for record in records::list(&self.cfg.vms_dir()) {
            if record.owner != self.cfg.owner {
                continue;
            }
            let running =
                record.liveness() == Liveness::Running && record.process.runs(WORKER_SUBCOMMAND);
            match (running, record.ready) {
                (true, _) if record.pages_from_host => {
                    // Its pages came from the daemon that died: untouched ones can never arrive.
                    tracing::warn!(id = %record.id, "killing a lazily restored VM whose page server is gone");
                    let _ = record.process.kill();
                    self.discard(&record);
                }
                (true, true) => {
                    tracing::info!(id = %record.id, pid = record.process.pid, "re-adopting a running VM");
                    vms.live.insert(
                        record.id.clone(),
                        Live {
                            record,
                            child: None,
                            ready: true,
                        },
                    );
                }
                (true, false) => {
                    tracing::warn!(id = %record.id, "killing a VM that was never made ready");
                    let _ = record.process.kill();
                    self.discard(&record);
                }
                (false, _) => {
                    tracing::info!(id = %record.id, "clearing the record of a VM that is gone");
                    self.discard(&record);
                }
            }
        }
    }

    /// Remove what an earlier process left half-done: snapshots being written, fetched or
    /// replaced, parents being booted, and children whose record never reached the disk (it
    /// is written unsynced: a crash that ended their processes can leave it missing or
    /// empty). Only entries older than an hour, so a CLI's snapshot or spawn in progress on
    /// the same data directory is left alone.
    fn sweep_leftovers(&self) {
        let old = |p: &std::path::Path| {
            std::fs::metadata(p)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > Duration::from_secs(3600))
        };
        // No record, or the empty file a crash can leave of one written unsynced.
        let unrecorded = |p: &std::path::Path| {
            std::fs::metadata(p.join("meta.json")).map_or(true, |m| m.len() == 0)
        };
        let sweep = |dir: PathBuf, prefixes: &[&str]| {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                return;
            };
            for e in entries.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let p = e.path();
                if prefixes.iter().any(|x| name.starts_with(x)) && unrecorded(&p) && old(&p) {
                    tracing::info!(path = %p.display(), "removing a leftover of an interrupted operation");
                    let _ = std::fs::remove_dir_all(&p);
                }
            }
        };
        // `..partial-…`: the VMM's own temporary directory beside a staging one (a snapshot
        // or branch whose writer was killed before it renamed it).
        sweep(
            self.cfg.snapshots_dir(),
            &[".partial-", "..partial-", ".fetch-", ".replaced-"],
        );
        // Every child's directory: parents and probes have no record until they are done,
        // children one from before their job.
        sweep(self.cfg.vms_dir(), &[""]);
    }
}

/// A tag claimed in [`Host`]'s `making` set for as long as this lives.
struct Making<'a> {
    set: &'a Mutex<HashSet<Tag>>,
    tag: Tag,
}

impl<'a> Making<'a> {
    fn claim(set: &'a Mutex<HashSet<Tag>>, tag: &Tag) -> Result<Making<'a>> {
        if !set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(tag.clone())
        {
            return Err(HostError::SnapshotBeingMade(tag.clone()));
        }
        Ok(Making {
            set,
            tag: tag.clone(),
        })
    }
}

impl Drop for Making<'_> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.tag);
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        // Prepared namespaces nobody will use; the children's stay with them (re-adopted).
        if let Some(net) = &self.network {
            net.drain_pool();
        }
    }
}

/// What this host's cgroup was charged for ([`Host::charge_snapshot`]).
#[derive(Default)]
struct Charged {
    /// Snapshot directory and state checksum.
    snapshots: HashSet<String>,
    files: HashSet<crate::cgroup::ChargedFile>,
}

/// The header of snapshot `tag` in `dir` (a broken one is the snapshot's error).
fn header_in(tag: &Tag, dir: &std::path::Path) -> Result<SnapshotHeader> {
    tine_vmm::snapshot::file::load_header(dir).map_err(|source| HostError::BadSnapshot {
        tag: tag.clone(),
        source,
    })
}

/// Send `req` to VM `id`'s VMM (its directory `dir`); a VMM that does not answer, or answers
/// that it failed, is the call's error.
fn ask_vmm(
    id: &SandboxId,
    dir: &std::path::Path,
    req: &crate::control::Request,
) -> Result<crate::control::Reply> {
    ask_vmm_then(id, dir, req, |_| {})
}

fn ask_vmm_then(
    id: &SandboxId,
    dir: &std::path::Path,
    req: &crate::control::Request,
    interim: impl FnMut(&crate::control::Reply),
) -> Result<crate::control::Reply> {
    let refuse = |reason: String| HostError::Branch {
        id: id.clone(),
        reason,
    };
    match crate::control::request_then(dir, req, BRANCH_TIMEOUT, interim)
        .map_err(|e| refuse(format!("its VMM did not answer: {e}")))?
    {
        crate::control::Reply::Failed { reason } => Err(refuse(reason)),
        reply => Ok(reply),
    }
}

/// Add the pages `again` (sorted) holds beyond `written` (sorted, kept so) to it, and those
/// not touched yet to the end of `ws` (in touch order, so they come last); how many were new
/// to `written`.
fn add_written_at_full_pace(ws: &mut Vec<u64>, written: &mut Vec<u64>, again: Vec<u64>) -> usize {
    let added: Vec<u64> = again
        .into_iter()
        .filter(|p| written.binary_search(p).is_err())
        .collect();
    let touched: std::collections::HashSet<u64> = ws.iter().copied().collect();
    ws.extend(added.iter().filter(|p| !touched.contains(p)));
    let n = added.len();
    written.extend(added);
    written.sort_unstable();
    n
}

/// A lazily restored child is ready: stop recording its working set (handing it to its page
/// source, if this child recorded one; a snapshot's recording child records on, see
/// [`Pages::records_past_ready`]) and report what its pages cost.
fn finish_recording(img: &Arc<dyn Pages>, pages: &ChildPages) -> LazyReport {
    use std::sync::atomic::Ordering::{Relaxed, Release};
    if !img.records_past_ready() {
        pages.ready.store(true, Release);
        let recorded = pages
            .recorded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(ws) = recorded.filter(|w| !w.is_empty()) {
            img.clone().recorded(ws);
        }
    }
    let (fetched_bytes, fetched_objects) = img.fetched();
    LazyReport {
        faults: pages.faults.load(Relaxed),
        pages_copied: pages.pages_copied.load(Relaxed),
        pages_zeroed: pages.pages_zeroed.load(Relaxed),
        pages_prefetched: pages.pages_prefetched.load(Relaxed),
        working_set_pages: img.working_set().map_or(0, |w| w.len() as u64),
        fetched_bytes,
        fetched_objects,
    }
}

/// Take an exclusive lock on `dir/host.lock` (released when the process ends).
fn lock_dir(dir: &std::path::Path) -> Result<crate::pidlock::PidLock> {
    crate::pidlock::lock(dir, "host.lock").map_err(|e| match e {
        crate::pidlock::LockError::Held { pid, .. } => HostError::Locked {
            dir: dir.to_path_buf(),
            why: format!(
                "an executor already runs on it (pid {}; one per data directory)",
                crate::pidlock::holder(pid)
            ),
        },
        crate::pidlock::LockError::Io { path, source } => {
            HostError::io(format!("locking {}", path.display()))(source)
        }
    })
}

/// The memory image the children of the snapshot in `dir` (its checked `header`) map under
/// its diffs: its root's. Only a diff's parents are read.
fn root_memory(dir: &std::path::Path, header: &SnapshotHeader) -> Result<PathBuf> {
    Ok(tine_vmm::snapshot::file::root_of(dir, header)?.join(MEMORY_FILE))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_written_at_full_pace_join_both_lists() {
        let mut ws = vec![7, 3, 9, 1];
        let mut written = vec![3, 9];
        // 9 is known; 1 was touched but not written; 5 was never touched.
        let added = add_written_at_full_pace(&mut ws, &mut written, vec![1, 5, 9]);
        assert_eq!(added, 2);
        assert_eq!(written, [1, 3, 5, 9], "sorted, each once");
        assert_eq!(ws, [7, 3, 9, 1, 5], "touch order kept, the new page last");
        assert_eq!(
            add_written_at_full_pace(&mut ws, &mut written, vec![3, 5]),
            0
        );
        assert_eq!(ws.len(), 5);
    }

    #[test]
    fn a_tag_is_made_by_one_attempt_at_a_time() {
        let set = Mutex::new(HashSet::new());
        let tag = Tag::parse("py").unwrap();
        let first = Making::claim(&set, &tag).unwrap();
        assert!(matches!(
            Making::claim(&set, &tag),
            Err(HostError::SnapshotBeingMade(t)) if t == tag
        ));
        // Other tags are not held up.
        let other = Making::claim(&set, &Tag::parse("np").unwrap()).unwrap();
        drop(first);
        let again = Making::claim(&set, &tag).unwrap();
        drop((again, other));
        assert!(set.lock().unwrap().is_empty());
    }
}
