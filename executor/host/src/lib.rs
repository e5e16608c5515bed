//! The one owner of the VMs on a host: warm parent snapshots, children restored by
//! pre-started VMM worker processes, their readiness, their on-disk records, and re-adoption
//! after a restart. Configured by one [`HostConfig`] value; it reads no environment. The
//! executor daemon and the `tine` CLI both use it.

pub mod cgroup;
pub mod config;
pub mod confine;
pub mod console;
pub mod control;
pub mod error;
pub mod fetch;
pub mod handoff;
mod host;
pub mod hot;
pub mod ksm;
pub mod layers;
pub mod lazy;
pub mod network;
pub mod pagemap;
pub mod parent;
pub mod pidlock;
pub mod pool_size;
pub mod process;
pub mod ready;
pub mod records;
pub mod smaps;
pub mod stack;
#[cfg(feature = "testing")]
pub mod testing;
pub mod worker;
pub mod worker_log;
pub mod zygote;

pub use cgroup::{CgroupMode, CgroupName, ChildLimits, Usage};
pub use config::{HostConfig, Limits, Owner, Readiness};
pub use confine::{Confinement, SeccompMode};
pub use control::BranchKind;
pub use error::{ErrorKind, HostError};
pub use fetch::FetchMode;
pub use host::{
    Branch, Ended, Host, LazyReport, Resources, Resumed, SpawnOptions, SpawnOutcome, VmInfo,
};
pub use layers::{Collected, Fetched, LayerInfo, StoreConfig, DEFAULT_GC_GRACE};
pub use parent::{MadeSnapshot, ParentSpec};
pub use process::{Liveness, ProcessIdentity};
pub use ready::SpawnPhases;
pub use records::VmRecord;
/// How a parent names its image (store only, or also a local directory).
pub use tine_image::ImageRef;
pub use worker::{worker_main, WORKER_SUBCOMMAND};
pub use zygote::WorkerStart;
