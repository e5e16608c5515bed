//! What can go wrong on a host, typed so each service can answer with the right status code
//! (the daemon maps [`ErrorKind`] to gRPC codes) and each message says what to do.

use std::path::PathBuf;
use std::time::Duration;

use tine_proto::names::{SandboxId, Tag};

use crate::config::Owner;

/// The class of an error, for status codes and metric labels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    NotFound,
    AlreadyExists,
    /// The host is full.
    Exhausted,
    /// The request cannot work in this state (e.g. VM work on a PVM host, a broken snapshot).
    Precondition,
    /// Not done in time.
    Deadline,
    /// Someone else owns it.
    Denied,
    /// Our own fault (I/O, a worker that could not start).
    Internal,
    /// The request asks for something out of bounds.
    Invalid,
    /// Stopped on request before it was done.
    Cancelled,
    /// Something this host depends on (the cluster's store) did not answer or answered wrong.
    Unavailable,
}

#[derive(Debug, thiserror::Error)]
pub enum HostError {
    #[error("snapshot {0} does not exist on this host")]
    NoSnapshot(Tag),
    #[error("snapshot {0} already exists (replace it explicitly)")]
    SnapshotExists(Tag),
    #[error("snapshot {0} is being made on this host already (an earlier attempt still runs); try again once it has ended")]
    SnapshotBeingMade(Tag),
    #[error("snapshot {tag} cannot be restored: {source}")]
    BadSnapshot {
        tag: Tag,
        #[source]
        source: tine_vmm::Error,
    },
    #[error("no VM {0} on this host (see `tine ls`)")]
    NoVm(SandboxId),
    #[error("VM {0} was killed before it was ready")]
    Cancelled(SandboxId),
    #[error("VM {0} exists already")]
    VmExists(SandboxId),
    #[error("VM {id} belongs to {owner}: stop it there (e.g. `tine sandbox kill {id}`)")]
    NotOwner { id: SandboxId, owner: Owner },
    #[error("this host is full: {running} of {max} VMs running")]
    Full { running: u32, max: u32 },
    #[error("{0}")]
    VmWorkRefused(String),
    #[error("image {image}: {reason}")]
    Image { image: String, reason: String },
    #[error("starting a VMM worker ({exe}): {source}")]
    Worker {
        exe: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("child VMM failed to restore: {log}")]
    RestoreFailed { log: String },
    #[error("child VMM did not restore within {0:?}")]
    RestoreTimeout(Duration),
    #[error("child VMM exited before it was ready: {log}")]
    VmmExited { log: String },
    #[error("not ready after {timeout:?}: {last}")]
    NotReady { timeout: Duration, last: String },
    #[error("{step} failed on the new child: {reason}")]
    Fixup { step: &'static str, reason: String },
    #[error(
        "VMM workers cannot confine themselves on this host: {log} (a root executor needs \
         CAP_SYS_ADMIN for their mount namespaces; `--vmm-uid-base off` runs them as the \
         executor's user without a view of their own, `--vmm-seccomp log` logs calls outside \
         the filter instead of stopping them)"
    )]
    Unconfined { log: String },
    #[error("the parent's VMM failed to boot it: {log}")]
    ParentBootFailed { log: String },
    #[error("writing the parent's snapshot: {reason}")]
    ParentSnapshot { reason: String },
    #[error("the parent never became ready (console: {console}): {reason}")]
    ParentNotReady { console: PathBuf, reason: String },
    #[error("warm-up code {code:?} raised:\n{error}")]
    WarmupFailed { code: String, error: String },
    #[error("warm-up code {code:?}: {reason}")]
    WarmupCall { code: String, reason: String },
    #[error("{what}: {reason}")]
    Store { what: String, reason: String },
    #[error("branching VM {id}: {reason}")]
    Branch { id: SandboxId, reason: String },
    #[error("reading VM {id}'s KVM counters: {reason}")]
    Counters { id: SandboxId, reason: String },
    #[error("snapshot {tag} has descendants on this host ({child}, ...): delete them first")]
    HasDescendants { tag: Tag, child: String },
    #[error("fetching snapshot {tag} from {store}: {reason}")]
    Fetch {
        tag: Tag,
        store: String,
        reason: String,
    },
    #[error("network: {what}: {reason}")]
    Network { what: String, reason: String },
    #[error("network: {0}")]
    NetworkRefused(String),
    #[error("resources: {0}")]
    Limits(String),
    #[error("resources: {0}")]
    NoCgroups(String),
    #[error("cgroup: {0}")]
    Cgroup(String),
    #[error("page merging was asked for, but {0}")]
    PageMerging(String),
    #[error(
        "VM {id} ran out of memory: the kernel killed its VMM at its limit of {limit_mib} MiB"
    )]
    OutOfMemory { id: SandboxId, limit_mib: u64 },
    #[error("another process owns {dir}: {why}")]
    Locked { dir: PathBuf, why: String },
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Vmm(#[from] tine_vmm::Error),
}

impl HostError {
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> HostError {
        let context = context.into();
        move |source| HostError::Io { context, source }
    }

    pub fn kind(&self) -> ErrorKind {
        use HostError::*;
        match self {
            NoSnapshot(_) | NoVm(_) => ErrorKind::NotFound,
            SnapshotExists(_) | VmExists(_) => ErrorKind::AlreadyExists,
            SnapshotBeingMade(_) => ErrorKind::Unavailable,
            Full { .. } | OutOfMemory { .. } => ErrorKind::Exhausted,
            Limits(_) => ErrorKind::Invalid,
            NotOwner { .. } | Locked { .. } => ErrorKind::Denied,
            RestoreTimeout(_) | NotReady { .. } => ErrorKind::Deadline,
            BadSnapshot { .. }
            | VmWorkRefused(_)
            | Image { .. }
            | RestoreFailed { .. }
            | VmmExited { .. }
            | Fixup { .. }
            | ParentNotReady { .. }
            | ParentBootFailed { .. }
            | Unconfined { .. }
            | WarmupFailed { .. }
            | WarmupCall { .. }
            | Branch { .. }
            | HasDescendants { .. }
            | NetworkRefused(_)
            | NoCgroups(_)
            | PageMerging(_) => ErrorKind::Precondition,
            Network { .. } => ErrorKind::Internal,
            Worker { .. }
            | Io { .. }
            | Vmm(_)
            | Store { .. }
            | Counters { .. }
            | Cgroup(_)
            | ParentSnapshot { .. } => ErrorKind::Internal,
            Fetch { .. } => ErrorKind::Unavailable,
            Cancelled(_) => ErrorKind::Cancelled,
        }
    }

    /// A short, stable label for metrics (`restore_failures_total{reason}`).
    pub fn reason(&self) -> &'static str {
        use HostError::*;
        match self {
            NoSnapshot(_) => "no_snapshot",
            SnapshotExists(_) => "snapshot_exists",
            SnapshotBeingMade(_) => "snapshot_being_made",
            BadSnapshot { .. } => "bad_snapshot",
            NoVm(_) => "no_vm",
            VmExists(_) => "vm_exists",
            NotOwner { .. } => "not_owner",
            Full { .. } => "full",
            VmWorkRefused(_) => "refused",
            Image { .. } => "image",
            Worker { .. } => "worker",
            RestoreFailed { .. } => "restore_failed",
            RestoreTimeout(_) => "restore_timeout",
            VmmExited { .. } => "vmm_exited",
            NotReady { .. } => "not_ready",
            Fixup { .. } => "fixup",
            ParentNotReady { .. } => "parent_not_ready",
            ParentBootFailed { .. } => "parent_boot_failed",
            Unconfined { .. } => "unconfined",
            ParentSnapshot { .. } => "parent_snapshot",
            WarmupFailed { .. } | WarmupCall { .. } => "warmup",
            Locked { .. } => "locked",
            Store { .. } => "store",
            Branch { .. } => "branch",
            Counters { .. } => "counters",
            HasDescendants { .. } => "has_descendants",
            Cancelled(_) => "cancelled",
            Fetch { .. } => "fetch",
            Network { .. } | NetworkRefused(_) => "network",
            Limits(_) | NoCgroups(_) => "resources",
            Cgroup(_) => "cgroup",
            PageMerging(_) => "page_merging",
            OutOfMemory { .. } => "out_of_memory",
            Io { .. } => "io",
            Vmm(_) => "vmm",
        }
    }
}

pub type Result<T, E = HostError> = std::result::Result<T, E>;
