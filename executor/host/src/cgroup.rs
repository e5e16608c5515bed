//! One cgroup v2 per child: its VMM process (every thread, and what KVM allocates for it) is
//! held to `memory.max` with no swap, `cpu.max` and `pids.max`, and an out-of-memory kill
//! takes the whole VMM (`memory.oom.group`) and nothing else.
//!
//! Layout under the executor's subtree `<root>`: `<root>/executor` holds the executor (cgroup
//! v2 lets only leaves hold processes) and `<root>/vms/<sandbox id>` each child. The subtree
//! is the parent of the executor's cgroup when that is a leaf named `executor` (systemd:
//! `Delegate=yes` with `DelegateSubgroup=executor`); else the executor's own cgroup when
//! nothing else runs there (it then moves itself into `<root>/executor`); else
//! `tine-<hash of the data dir>` at the top of the hierarchy, the same at every start.
//!
//! Shared snapshot pages are charged to the executor's own cgroup: it reads a snapshot's
//! memory files before the first child maps them, once per file ([`charge_snapshot`]), so a
//! child's `memory.current` counts the pages it wrote (and its VMM), not the image it shares.
//!
//! A pre-started worker waits in a cgroup of its own, `<root>/vms/.idle-<executor pid>-<n>`
//! ([`IdleCgroup`]), which the executor moves it into as it starts; the spawn that takes it
//! keeps that cgroup as the child's (cgroup v2 cannot rename one) and sets the child's limits.
//! Making a cgroup and moving a process into one leave the spawn's path, and what the worker
//! mapped while it waited (all but its loader's first pages, a priming's copies) is charged to
//! the child it becomes.

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tine_proto::names::SandboxId;

/// The controllers a child's limits need.
const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];
/// `cpu.max`'s period: the quota is a share of it.
const CPU_PERIOD_US: u64 = 100_000;

pub use tine_proto::limits::{
    MIN_CPU_MILLIS as CPU_MILLIS_MIN, MIN_MEMORY_LIMIT_MIB as MEMORY_FLOOR_MIB,
};
/// Added to the guest's RAM for the default limit: the VMM and KVM's own memory.
pub const VMM_OVERHEAD_MIB: u64 = 128;
/// Processes and threads per VMM: vCPU and device threads and a LIVE branch's copier, with
/// room to spare; a VMM made to spawn without bound stops here.
pub const PIDS_MAX: u32 = 128;

/// Where the children's cgroups go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum CgroupMode {
    /// No cgroups: spawns asking for limits are refused.
    Off,
    /// The executor's own cgroup if it has it to itself, else one at the top (see the module
    /// documentation); none, with a warning, where cgroup v2 or its controllers are missing.
    #[default]
    Auto,
    /// This cgroup directory, which the executor must be able to write.
    At(PathBuf),
}

/// What one child is held to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChildLimits {
    pub memory_max_mib: u64,
    /// Thousandths of a core (None: unlimited).
    pub cpu_millis: Option<u32>,
    pub pids_max: u32,
}

impl ChildLimits {
    /// The limits for a child of a guest with `guest_mib` of RAM that asked for
    /// `memory_limit_mib` (0: the default, the guest's RAM plus the VMM's overhead) and
    /// `cpu_millis` (0: unlimited), or why they are refused.
    pub fn for_child(
        guest_mib: u64,
        memory_limit_mib: u64,
        cpu_millis: u32,
        host_cpus: u32,
    ) -> Result<ChildLimits, String> {
        let memory_max_mib = match memory_limit_mib {
            0 => guest_mib + VMM_OVERHEAD_MIB,
            m if m > tine_proto::limits::MAX_MEMORY_LIMIT_MIB => {
                return Err(format!(
                    "memory_limit_mib {m} is over the maximum of {} MiB",
                    tine_proto::limits::MAX_MEMORY_LIMIT_MIB
                ))
            }
            m if m < MEMORY_FLOOR_MIB => {
                return Err(format!(
                    "memory_limit_mib {m} is below a child's floor of {MEMORY_FLOOR_MIB} MiB \
                     (its VMM, KVM's page tables and what it writes while it is made ready)"
                ))
            }
            m => m,
        };
        let cpu_millis = match cpu_millis {
            0 => None,
            c if c < CPU_MILLIS_MIN => {
                return Err(format!(
                    "cpu_millis {c} is below the floor of {CPU_MILLIS_MIN} (1% of a core)"
                ))
            }
            c if c > host_cpus.saturating_mul(1000) => {
                return Err(format!(
                    "cpu_millis {c} is more than this executor's {host_cpus} CPUs ({} millis)",
                    host_cpus.saturating_mul(1000)
                ))
            }
            c => Some(c),
        };
        Ok(ChildLimits {
            memory_max_mib,
            cpu_millis,
            pids_max: PIDS_MAX,
        })
    }

    /// `cpu.max`: quota and period in microseconds.
    fn cpu_max(&self) -> String {
        match self.cpu_millis {
            Some(m) => format!("{} {CPU_PERIOD_US}", u64::from(m) * CPU_PERIOD_US / 1000),
            None => format!("max {CPU_PERIOD_US}"),
        }
    }
}

/// What a child's cgroup counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub memory_current: u64,
    /// The most it held (0 where the kernel does not keep `memory.peak`).
    pub memory_peak: u64,
    pub memory_max: Option<u64>,
    pub cpu_usage: Duration,
    /// Times the kernel killed in it for want of memory.
    pub oom_kills: u64,
    /// Periods in which it was held back by `cpu.max`.
    pub cpu_throttled: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// This host cannot give children cgroups (no cgroup v2, controllers missing, not ours).
    #[error("{0}")]
    Unavailable(String),
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io { what, path, source }
}

/// The executor's subtree, set up.
#[derive(Debug)]
pub struct Cgroups {
    root: PathBuf,
    vms: PathBuf,
    /// Numbers the idle workers' cgroups.
    next_idle: AtomicU64,
}

/// Where an idle cgroup's name starts: a sandbox id starts with a letter or digit, so it
/// never meets one.
const IDLE_PREFIX: &str = ".idle-";

/// The name of a child's cgroup under `<root>/vms`: its sandbox id (one made for it at its
/// spawn) or an idle worker's (see [`IdleCgroup`]). Never a path: nothing else is one.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CgroupName(String);

impl CgroupName {
    /// The name of a cgroup made for child `id`.
    pub fn of(id: &SandboxId) -> CgroupName {
        CgroupName(id.as_str().to_string())
    }

    /// `name` if it is one this module makes (e.g. read back from a record), else None.
    pub fn parse(name: &str) -> Option<CgroupName> {
        let idle = name
            .strip_prefix(IDLE_PREFIX)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit() || b == b'-'));
        (idle || SandboxId::parse(name).is_ok()).then(|| CgroupName(name.to_string()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A cgroup made ahead for a pre-started worker (see [`Cgroups::make_idle`]): the executor
/// moves the worker in as it starts ([`IdleCgroup::enter`]), so everything it maps while it
/// waits (a priming's copies included) is charged there, and the child it serves keeps it ([`Cgroups::limit`],
/// [`IdleCgroup::keep`]) instead of a cgroup made and entered on the spawn's path. Removed
/// when dropped unless kept; drop it only once its worker is gone.
#[derive(Debug)]
pub struct IdleCgroup {
    name: CgroupName,
    dir: PathBuf,
    kept: bool,
}

impl IdleCgroup {
    /// Move process `pid` (its worker) in.
    pub fn enter(&self, pid: u32) -> Result<(), CgroupError> {
        write(&self.dir.join("cgroup.procs"), &pid.to_string())
    }

    /// Its `cgroup.procs`, open for writing: a process that writes `0` to it moves itself in.
    pub fn procs_file(&self) -> std::io::Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.procs"))
    }

    pub fn name(&self) -> &CgroupName {
        &self.name
    }

    /// Leave it in place: from now on it is its child's, removed with it
    /// ([`Cgroups::remove`]).
    pub fn keep(mut self) -> CgroupName {
        self.kept = true;
        self.name.clone()
    }
}

impl Drop for IdleCgroup {
    fn drop(&mut self) {
        if !self.kept {
            remove_when_empty(&self.dir);
        }
    }
}

impl Cgroups {
    /// Set up the subtree for `mode` (None for [`CgroupMode::Off`]). Call before starting
    /// any process: moving the executor into its own leaf must not leave others behind.
    pub fn open(mode: &CgroupMode, data_dir: &Path) -> Result<Option<Cgroups>, CgroupError> {
        let root = match mode {
            CgroupMode::Off => return Ok(None),
            CgroupMode::At(p) => {
                if !p.join("cgroup.controllers").exists() {
                    return Err(CgroupError::Unavailable(format!(
                        "{} is not a cgroup v2 directory",
                        p.display()
                    )));
                }
                p.clone()
            }
            CgroupMode::Auto => auto_root(data_dir)?,
        };
        let auto = *mode == CgroupMode::Auto;
        match Cgroups::open_at(root) {
            // Auto takes what it can: a hierarchy it may not write (not root, a read-only
            // cgroupfs in a container) means no cgroups, not no executor.
            Err(CgroupError::Io { what, path, source }) if auto => Err(CgroupError::Unavailable(
                format!("{what} {}: {source}", path.display()),
            )),
            r => r.map(Some),
        }
    }

    /// Take `root` (created if missing): the executor into its leaf if it runs in `root`,
    /// the controllers enabled for the children.
    fn open_at(root: PathBuf) -> Result<Cgroups, CgroupError> {
        if !root.exists() {
            // Nothing is made where the controllers cannot be had.
            let parent = root.parent().unwrap_or(&root);
            let missing = lacking(&parent.join("cgroup.controllers"));
            if !missing.is_empty() {
                return Err(CgroupError::Unavailable(format!(
                    "cgroup v2 at {} lacks the {} controller(s) (held by cgroup v1?)",
                    parent.display(),
                    missing.join(", ")
                )));
            }
            // Best effort: only needed (and only allowed) where they are not enabled yet.
            let _ = enable(parent);
            mkdir(&root)?;
        }
        let missing = lacking(&root.join("cgroup.controllers"));
        if !missing.is_empty() {
            return Err(CgroupError::Unavailable(format!(
                "cgroup {} lacks the {} controller(s): cgroup v2 must hold them (not cgroup v1)",
                root.display(),
                missing.join(", ")
            )));
        }
        // Processes in `root` itself (us) go to a leaf before controllers are enabled there.
        let me = std::process::id().to_string();
        let procs = read_words(&root.join("cgroup.procs"));
        if !procs.is_empty() {
            let leaf = root.join("executor");
            mkdir(&leaf)?;
            for pid in &procs {
                if *pid != me {
                    return Err(CgroupError::Unavailable(format!(
                        "cgroup {} holds other processes (pid {pid}); give the executor a \
                         cgroup of its own (systemd: Delegate=yes) or name one",
                        root.display()
                    )));
                }
            }
            write(&leaf.join("cgroup.procs"), &me)?;
        }
        enable(&root)?;
        let vms = root.join("vms");
        mkdir(&vms)?;
        enable(&vms)?;
        tracing::info!(root = %root.display(), "children get their own cgroups");
        Ok(Cgroups {
            root,
            vms,
            next_idle: AtomicU64::new(0),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The cgroup named `name` (a child's: see [`CgroupName`]).
    pub fn dir(&self, name: &CgroupName) -> PathBuf {
        self.vms.join(&name.0)
    }

    /// Make a cgroup for child `id` with `limits` and move `pid` into it; returns its name.
    pub fn attach(
        &self,
        id: &SandboxId,
        limits: &ChildLimits,
        pid: u32,
    ) -> Result<CgroupName, CgroupError> {
        let name = CgroupName::of(id);
        let dir = self.dir(&name);
        mkdir(&dir)?;
        let made = (|| {
            set_limits(&dir, limits)?;
            set_fixed(&dir, limits.pids_max)?;
            write(&dir.join("cgroup.procs"), &pid.to_string())
        })();
        if made.is_err() {
            let _ = std::fs::remove_dir(&dir);
        }
        made.map(|()| name)
    }

    /// A cgroup for a worker about to be pre-started: held to what does not depend on the
    /// child (no swap, `pids.max`, an out-of-memory kill takes the group), not yet to a
    /// memory or CPU limit. Its name cannot be a sandbox id's.
    pub fn make_idle(&self) -> Result<IdleCgroup, CgroupError> {
        // A crashed executor's may still be there (with a worker that has not exited yet).
        let mut tries = 0;
        let (name, dir) = loop {
            let n = self.next_idle.fetch_add(1, Ordering::Relaxed);
            let name = format!("{IDLE_PREFIX}{}-{n}", std::process::id());
            let dir = self.vms.join(&name);
            match std::fs::create_dir(&dir) {
                Ok(()) => break (name, dir),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && tries < 64 => tries += 1,
                Err(e) => return Err(io("creating cgroup", &dir)(e)),
            }
        };
        match set_fixed(&dir, PIDS_MAX) {
            Ok(()) => Ok(IdleCgroup {
                name: CgroupName(name),
                dir,
                kept: false,
            }),
            Err(e) => {
                let _ = std::fs::remove_dir(&dir);
                Err(e)
            }
        }
    }

    /// Hold `idle`, whose worker is about to serve a child, to that child's `limits`. It
    /// keeps its name (cgroup v2 cannot rename a cgroup), which the child's record keeps.
    pub fn limit(&self, idle: &IdleCgroup, limits: &ChildLimits) -> Result<(), CgroupError> {
        set_limits(&idle.dir, limits)?;
        if limits.pids_max != PIDS_MAX {
            write(&idle.dir.join("pids.max"), &limits.pids_max.to_string())?;
        }
        Ok(())
    }

    /// What the cgroup `name` counted (None: there is none).
    pub fn usage(&self, name: &CgroupName) -> Option<Usage> {
        read_usage(&self.dir(name))
    }

    /// Remove the cgroup `name` once its processes are gone (they may still be exiting).
    pub fn remove(&self, name: &CgroupName) {
        remove_when_empty(&self.dir(name));
    }

    /// Remove the cgroups of children that are not in `keep` (left by a crashed executor).
    pub fn sweep(&self, keep: &HashSet<String>) {
        let Ok(entries) = std::fs::read_dir(&self.vms) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if e.path().is_dir() && !keep.contains(&name) {
                if !read_words(&e.path().join("cgroup.procs")).is_empty() {
                    tracing::warn!(cgroup = %e.path().display(), "a child's cgroup still holds processes; leaving it");
                    continue;
                }
                remove_when_empty(&e.path());
            }
        }
    }
}

/// Where cgroup v2 is mounted with the controllers children need, or why children cannot
/// get cgroups here; creates nothing (`tine doctor`).
pub fn probe() -> Result<PathBuf, String> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mount = cgroup2_mount(&mountinfo).ok_or("no cgroup v2 hierarchy is mounted")?;
    let missing = lacking(&mount.join("cgroup.controllers"));
    if missing.is_empty() {
        Ok(mount)
    } else {
        Err(format!(
            "cgroup v2 at {} lacks the {} controller(s) (held by cgroup v1?)",
            mount.display(),
            missing.join(", ")
        ))
    }
}

/// The subtree for [`CgroupMode::Auto`].
fn auto_root(data_dir: &Path) -> Result<PathBuf, CgroupError> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mount = cgroup2_mount(&mountinfo)
        .ok_or_else(|| CgroupError::Unavailable("no cgroup v2 hierarchy is mounted".to_string()))?;
    let own = own_cgroup(&std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default())
        .ok_or_else(|| CgroupError::Unavailable("this process is not in cgroup v2".into()))?;
    let top = mount.join(format!("tine-{:08x}", path_hash(data_dir)));
    if own == "/" {
        return Ok(top);
    }
    let dir = mount.join(own.trim_start_matches('/'));
    // Started in a leaf named `executor` (systemd's `DelegateSubgroup=executor`, or a process
    // an earlier start moved there): its parent is the subtree.
    if dir.file_name().is_some_and(|n| n == "executor") {
        if let Some(parent) = dir.parent().filter(|p| *p != mount) {
            return Ok(parent.to_path_buf());
        }
    }
    let me = std::process::id().to_string();
    let procs = read_words(&dir.join("cgroup.procs"));
    if procs.iter().all(|p| *p == me) {
        Ok(dir)
    } else {
        Ok(top)
    }
}

/// Where cgroup v2 is mounted, from `/proc/self/mountinfo`: `/sys/fs/cgroup` when it is
/// there, else the first.
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    let mut found = Vec::new();
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        if right.split_whitespace().next() != Some("cgroup2") {
            continue;
        }
        let mut f = left.split_whitespace();
        let (root, point) = (f.nth(3), f.next());
        // A mount of a sub-tree (a container's) has a root other than "/".
        if let (Some("/"), Some(p)) = (root, point) {
            found.push(PathBuf::from(p.replace("\\040", " ")));
        }
    }
    found
        .iter()
        .find(|p| *p == Path::new("/sys/fs/cgroup"))
        .or(found.first())
        .cloned()
}

/// This process's cgroup v2 path (`0::/path` in `/proc/self/cgroup`).
fn own_cgroup(proc_cgroup: &str) -> Option<String> {
    proc_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim().to_string())
}

/// FNV-1a of the canonical path: the same name at every start of one executor (its
/// cgroup subtree and its host nftables table).
pub fn path_hash(p: &Path) -> u32 {
    let path = p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h as u32
}

/// The controllers children need that the list in `file` lacks.
fn lacking(file: &Path) -> Vec<&'static str> {
    let listed = read_words(file);
    CONTROLLERS
        .into_iter()
        .filter(|c| !listed.iter().any(|l| l == c))
        .collect()
}

fn read_words(p: &Path) -> Vec<String> {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// What a child asked for: its memory and CPU.
fn set_limits(dir: &Path, limits: &ChildLimits) -> Result<(), CgroupError> {
    write(
        &dir.join("memory.max"),
        &(limits.memory_max_mib << 20).to_string(),
    )?;
    write(&dir.join("cpu.max"), &limits.cpu_max())
}

/// What every child is held to: no swap, `pids_max`, one out-of-memory kill for the group.
fn set_fixed(dir: &Path, pids_max: u32) -> Result<(), CgroupError> {
    // Absent where swap is not accounted: there is no swap to hold back then.
    let swap = dir.join("memory.swap.max");
    if swap.exists() {
        write(&swap, "0")?;
    }
    write(&dir.join("memory.oom.group"), "1")?;
    write(&dir.join("pids.max"), &pids_max.to_string())
}

fn write(p: &Path, v: &str) -> Result<(), CgroupError> {
    std::fs::write(p, v).map_err(io("writing", p))
}

fn mkdir(p: &Path) -> Result<(), CgroupError> {
    match std::fs::create_dir(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io("creating cgroup", p)(e)),
    }
}

/// Enable the controllers for `dir`'s children (those already enabled are left).
fn enable(dir: &Path) -> Result<(), CgroupError> {
    let want: Vec<String> = lacking(&dir.join("cgroup.subtree_control"))
        .into_iter()
        .map(|c| format!("+{c}"))
        .collect();
    if want.is_empty() {
        return Ok(());
    }
    write(&dir.join("cgroup.subtree_control"), &want.join(" "))
}

/// `key value` lines (memory.events, cpu.stat).
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

fn read_usage(dir: &Path) -> Option<Usage> {
    let num = |f: &str| -> Option<u64> {
        std::fs::read_to_string(dir.join(f))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    };
    let memory_current = num("memory.current")?;
    let events = std::fs::read_to_string(dir.join("memory.events")).unwrap_or_default();
    let cpu = std::fs::read_to_string(dir.join("cpu.stat")).unwrap_or_default();
    Some(Usage {
        memory_current,
        memory_peak: num("memory.peak").unwrap_or(0),
        memory_max: num("memory.max"),
        cpu_usage: Duration::from_micros(keyed(&cpu, "usage_usec").unwrap_or(0)),
        oom_kills: keyed(&events, "oom_kill").unwrap_or(0),
        cpu_throttled: keyed(&cpu, "nr_throttled").unwrap_or(0),
    })
}

/// What the kernel holds for a cgroup besides the pages its processes map, in bytes, from
/// its `memory.stat`: kernel stacks of its threads, its processes' page tables, KVM's page
/// tables for its guests (`sec_pagetables`, Linux 6.1+), slab, per-CPU data and vmalloc. The
/// keys a kernel does not count are left out.
pub const KERNEL_MEMORY: [&str; 6] = [
    "kernel_stack",
    "pagetables",
    "sec_pagetables",
    "slab",
    "percpu",
    "vmalloc",
];

/// The [`KERNEL_MEMORY`] counters of the cgroup at `dir` (None: unreadable, e.g. no such
/// cgroup). Its `memory.current` is in its [`Usage`].
pub fn kernel_memory(dir: &Path) -> Option<Vec<(&'static str, u64)>> {
    let stat = std::fs::read_to_string(dir.join("memory.stat")).ok()?;
    Some(
        KERNEL_MEMORY
            .iter()
            .filter_map(|k| Some((*k, keyed(&stat, k)?)))
            .collect(),
    )
}

/// rmdir, retried while the last process is still exiting (up to a second).
fn remove_when_empty(dir: &Path) {
    for _ in 0..100 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => {
                tracing::warn!(cgroup = %dir.display(), "removing a child's cgroup: {e}");
                return;
            }
        }
    }
    tracing::warn!(cgroup = %dir.display(), "a child's cgroup still holds processes; the next start removes it");
}

/// Read the loadable segments of the ELF program `exe` from this process, so the page cache
/// holding them is charged to the executor's cgroup rather than to the first idle worker's
/// (and so its child's): workers enter their cgroups before they exec. Returns the bytes
/// read; a file that is not a 64-bit little-endian ELF is an error.
pub fn charge_program(exe: &Path) -> std::io::Result<u64> {
    let f = std::fs::File::open(exe)?;
    let mut head = [0u8; 64];
    f.read_exact_at(&mut head, 0)?;
    if &head[..4] != b"\x7fELF" || head[4] != 2 || head[5] != 1 {
        return Err(std::io::Error::other("not a 64-bit little-endian ELF file"));
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]) as u64;
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let (phoff, phentsize, phnum) = (u64_at(&head, 32), u16_at(&head, 54), u16_at(&head, 56));
    if phentsize < 56 || phnum > 256 {
        return Err(std::io::Error::other("unexpected ELF program headers"));
    }
    const PT_LOAD: u32 = 1;
    let size = f.metadata()?.len();
    let mut total = 0;
    let mut buf = vec![0u8; 1 << 20];
    let mut ph = vec![0u8; phentsize as usize];
    for i in 0..phnum {
        f.read_exact_at(&mut ph, phoff + i * phentsize)?;
        if u32_at(&ph, 0) != PT_LOAD {
            continue;
        }
        let (offset, filesz) = (u64_at(&ph, 8), u64_at(&ph, 32));
        let end = offset.saturating_add(filesz).min(size);
        let mut at = offset;
        while at < end {
            let n = ((end - at) as usize).min(buf.len());
            let got = f.read_at(&mut buf[..n], at)?;
            if got == 0 {
                break;
            }
            at += got as u64;
            total += got as u64;
        }
    }
    Ok(total)
}

/// A memory file as it was charged: a file replaced or rewritten since is another key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ChargedFile {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl ChargedFile {
    fn of(meta: &std::fs::Metadata) -> ChargedFile {
        use std::os::unix::fs::MetadataExt;
        ChargedFile {
            dev: meta.dev(),
            ino: meta.ino(),
            len: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }
}

/// What [`charge_snapshot`] did.
#[derive(Debug, Default)]
pub struct Charged {
    /// Bytes read (those not in the page cache yet).
    pub bytes: u64,
    /// The files scanned, now charged.
    pub files: Vec<ChargedFile>,
    /// Files skipped because `known` said they were charged already.
    pub known: usize,
}

/// Read the data of a snapshot's memory files (its diff chain's too) from this process,
/// so the page cache holding them is charged to the executor's cgroup rather than to the
/// first child that maps them. Holes are skipped: a hole read would fill the cache with
/// zero pages nobody maps. Files `known` says were charged before are not scanned again: a
/// new branch of a snapshot shares its chain's files, and the root's image is most of it.
pub fn charge_snapshot(
    dir: &Path,
    known: impl Fn(&ChargedFile) -> bool,
) -> std::io::Result<Charged> {
    let mut out = Charged::default();
    let mut dir = dir.to_path_buf();
    for _ in 0..256 {
        for f in [
            tine_vmm::snapshot::file::MEMORY_FILE,
            tine_vmm::snapshot::diff::PAGES_FILE,
        ] {
            let file = match std::fs::File::open(dir.join(f)) {
                Ok(file) => file,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let key = ChargedFile::of(&file.metadata()?);
            if known(&key) {
                out.known += 1;
                continue;
            }
            out.bytes += read_data(&file)?;
            out.files.push(key);
        }
        let header = tine_vmm::snapshot::file::load_header(&dir).ok();
        match header.and_then(|h| h.diff) {
            Some(d) if !d.parent.contains('/') => {
                dir = dir.with_file_name(&d.parent);
            }
            _ => break,
        }
    }
    Ok(out)
}

/// Read the data extents of `file` (SEEK_DATA / SEEK_HOLE) that are not in the page cache
/// yet, discarding them. Resident pages are charged to whoever brought them in already, and
/// reading them would change nothing, so a later call costs a residency scan only.
fn read_data(file: &std::fs::File) -> std::io::Result<u64> {
    use std::os::fd::AsRawFd;
    const CHUNK: usize = 1 << 20;
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(0);
    }
    let fd = file.as_raw_fd();
    // SAFETY: a fresh shared read-only mapping of our own file, only passed to mincore and
    // unmapped below; nothing dereferences it.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len as usize,
            libc::PROT_READ,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    let page = 4096usize;
    let mut vec = vec![0u8; CHUNK / page];
    let mut buf = vec![0u8; CHUNK];
    let (mut pos, mut total) = (0u64, 0u64);
    let result = (|| {
        while pos < len {
            // SAFETY: lseek on a descriptor we own; no memory is touched.
            let data = unsafe { libc::lseek(fd, pos as i64, libc::SEEK_DATA) };
            if data < 0 {
                break; // ENXIO: no data past `pos`.
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
            let end = if hole < 0 {
                len
            } else {
                (hole as u64).min(len)
            };
            // Whole pages, so mincore's address is aligned.
            let mut at = data as u64 & !(page as u64 - 1);
            while at < end {
                let n = ((end - at) as usize).min(CHUNK);
                let pages = n.div_ceil(page);
                // SAFETY: `at..at + n` lies inside the mapping; `vec` has a byte per page.
                let rc = unsafe {
                    libc::mincore(
                        (map as *mut u8).add(at as usize).cast(),
                        n,
                        vec.as_mut_ptr(),
                    )
                };
                if rc != 0 || vec[..pages].iter().any(|r| r & 1 == 0) {
                    let got = file.read_at(&mut buf[..n], at)?;
                    if got == 0 {
                        break;
                    }
                    total += got as u64;
                    at += got as u64;
                } else {
                    at += n as u64;
                }
            }
            pos = end.max(at);
        }
        Ok(total)
    })();
    // SAFETY: the mapping made above, unmapped once.
    unsafe { libc::munmap(map, len as usize) };
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_default_to_the_guest_plus_overhead_and_refuse_below_the_floor() {
        let l = ChildLimits::for_child(512, 0, 0, 4).unwrap();
        assert_eq!(l.memory_max_mib, 512 + VMM_OVERHEAD_MIB);
        assert_eq!(l.cpu_millis, None);
        assert_eq!(l.cpu_max(), "max 100000");
        let l = ChildLimits::for_child(512, 128, 250, 4).unwrap();
        assert_eq!(
            (l.memory_max_mib, l.cpu_max()),
            (128, "25000 100000".into())
        );
        let e = ChildLimits::for_child(512, 16, 0, 4).unwrap_err();
        assert!(
            e.contains("memory_limit_mib 16") && e.contains("floor of 64 MiB"),
            "{e}"
        );
        let e = ChildLimits::for_child(512, 0, 5, 4).unwrap_err();
        assert!(
            e.contains("cpu_millis 5") && e.contains("floor of 10"),
            "{e}"
        );
        let e = ChildLimits::for_child(512, 1 << 44, 0, 4).unwrap_err();
        assert!(e.contains("over the maximum"), "{e}");
        let e = ChildLimits::for_child(512, 0, 4001, 4).unwrap_err();
        assert!(e.contains("4 CPUs"), "{e}");
        assert!(ChildLimits::for_child(512, 0, 4000, 4).is_ok());
    }

    #[test]
    fn the_cgroup2_mount_and_own_cgroup_are_found() {
        let mi = "\
29 23 0:26 / /sys/fs/cgroup/memory rw,relatime shared:11 - cgroup cgroup rw,memory
30 23 0:27 /sub /sys/fs/cgroup/ns rw,relatime - cgroup2 cgroup2 rw
31 23 0:28 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw
32 23 0:29 / /sys/fs/cgroup rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate";
        assert_eq!(cgroup2_mount(mi), Some(PathBuf::from("/sys/fs/cgroup")));
        assert_eq!(
            cgroup2_mount(&mi.lines().take(3).collect::<Vec<_>>().join("\n")),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(cgroup2_mount(mi.lines().next().unwrap()), None);
        let pc = "4:memory:/x\n0::/system.slice/tine-executor.service\n";
        assert_eq!(
            own_cgroup(pc).as_deref(),
            Some("/system.slice/tine-executor.service")
        );
        assert_eq!(own_cgroup("4:memory:/x\n"), None);
    }

    #[test]
    fn cgroup_names_read_back_are_never_paths() {
        let id = SandboxId::random("t");
        assert_eq!(CgroupName::parse(id.as_str()), Some(CgroupName::of(&id)));
        assert!(CgroupName::parse(".idle-41-7").is_some());
        for bad in [
            "",
            ".",
            "..",
            "../x",
            "a/b",
            ".idle-",
            ".idle-1/..",
            ".idle-x",
            "/etc",
        ] {
            assert_eq!(CgroupName::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_program_s_loadable_segments_are_read() {
        // This test's own binary: its segments are part of the file, never more.
        let exe = std::env::current_exe().unwrap();
        let read = charge_program(&exe).unwrap();
        let size = std::fs::metadata(&exe).unwrap().len();
        assert!(read > 0 && read <= size, "{read} of {size}");
        let tmp = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(
            tmp.path(),
            b"#!/bin/sh\necho not an ELF file, but long enough to read a header from it\n",
        )
        .unwrap();
        assert!(charge_program(tmp.path()).is_err());
    }

    #[test]
    fn kernel_memory_is_read_from_memory_stat() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        assert_eq!(kernel_memory(d), None);
        // A kernel before 6.1: no sec_pagetables. "slab_reclaimable" must not pass for "slab".
        std::fs::write(
            d.join("memory.stat"),
            "anon 1048576\nfile 0\nkernel 262144\nkernel_stack 65536\npagetables 40960\n\
             percpu 1120\nsock 0\nvmalloc 8192\nslab_reclaimable 4096\nslab 20480\n",
        )
        .unwrap();
        assert_eq!(
            kernel_memory(d).unwrap(),
            vec![
                ("kernel_stack", 65536),
                ("pagetables", 40960),
                ("slab", 20480),
                ("percpu", 1120),
                ("vmalloc", 8192)
            ]
        );
    }

    #[test]
    fn usage_is_read_from_the_cgroup_files() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path();
        std::fs::write(d.join("memory.current"), "1048576\n").unwrap();
        std::fs::write(d.join("memory.max"), "134217728\n").unwrap();
        std::fs::write(
            d.join("memory.events"),
            "low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 1\n",
        )
        .unwrap();
        std::fs::write(
            d.join("cpu.stat"),
            "usage_usec 2500000\nuser_usec 1\nsystem_usec 2\nnr_periods 30\nnr_throttled 12\n",
        )
        .unwrap();
        let u = read_usage(d).unwrap();
        assert_eq!(
            u,
            Usage {
                memory_current: 1 << 20,
                memory_peak: 0,
                memory_max: Some(128 << 20),
                cpu_usage: Duration::from_millis(2500),
                oom_kills: 1,
                cpu_throttled: 12,
            }
        );
        // "max" (no limit) is not a number.
        std::fs::write(d.join("memory.max"), "max\n").unwrap();
        assert_eq!(read_usage(d).unwrap().memory_max, None);
        assert!(read_usage(&d.join("missing")).is_none());
    }

    #[test]
    fn charging_reads_only_data_not_cached_yet() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("base");
        std::fs::create_dir(&base).unwrap();
        let f = std::fs::File::create(base.join(tine_vmm::snapshot::file::MEMORY_FILE)).unwrap();
        f.set_len(64 << 20).unwrap();
        f.write_all_at(&[1u8; 8192], 32 << 20).unwrap();
        // A 64 MiB sparse image with 8 KiB of data: far less than the size is read (a
        // filesystem may round extents up, never to the whole file).
        let n = charge_snapshot(&base, |_| false).unwrap().bytes;
        // Written just now, so maybe still cached: then nothing needs reading.
        assert!(n < (1 << 20), "{n}");
        // Dropped from the cache, it is read again: only its data.
        let f = std::fs::File::open(base.join(tine_vmm::snapshot::file::MEMORY_FILE)).unwrap();
        f.sync_all().unwrap();
        // SAFETY: advice on our own descriptor.
        unsafe {
            libc::posix_fadvise(
                std::os::fd::AsRawFd::as_raw_fd(&f),
                0,
                0,
                libc::POSIX_FADV_DONTNEED,
            )
        };
        let n = charge_snapshot(&base, |_| false).unwrap().bytes;
        assert!((8192..(1 << 20)).contains(&n), "{n}");
        // Resident now: a second pass reads nothing.
        assert_eq!(charge_snapshot(&base, |_| false).unwrap().bytes, 0);
    }

    /// A file charged before is not scanned again (a new branch shares its chain's files);
    /// the same path rewritten is a new file.
    #[test]
    fn files_charged_before_are_skipped_until_rewritten() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("snap");
        std::fs::create_dir(&dir).unwrap();
        let memory = dir.join(tine_vmm::snapshot::file::MEMORY_FILE);
        let pages = dir.join(tine_vmm::snapshot::diff::PAGES_FILE);
        std::fs::write(&memory, [1u8; 4096]).unwrap();
        std::fs::write(&pages, [2u8; 4096]).unwrap();
        let first = charge_snapshot(&dir, |_| false).unwrap();
        assert_eq!((first.files.len(), first.known), (2, 0));
        let memory_key = first.files[0].clone();
        let again = charge_snapshot(&dir, |f| *f == memory_key).unwrap();
        assert_eq!((again.files.len(), again.known), (1, 1));
        assert_ne!(
            again.files[0], memory_key,
            "the pages file is scanned, not the image"
        );
        // Replaced, as a snapshot made again writes it: another file, scanned again.
        std::fs::remove_file(&memory).unwrap();
        std::fs::write(&memory, [3u8; 8192]).unwrap();
        let replaced = charge_snapshot(&dir, |f| *f == memory_key).unwrap();
        assert_eq!((replaced.files.len(), replaced.known), (2, 0));
    }
}
