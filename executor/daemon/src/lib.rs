//! The per-host executor: VM bookkeeping under the data directory, warm parent snapshots,
//! child readiness, the VMM worker pool, and the executor gRPC daemon.

pub mod console;
pub mod daemon;
pub mod parent;
pub mod ready;
pub mod service;
pub mod vms;
pub mod worker;
