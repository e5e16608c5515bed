//! The executor daemon: serves the executor gRPC API over this host's [`tine_host::Host`],
//! registers and heartbeats with the control plane, and exports its metrics.

mod agent_calls;
pub mod daemon;
pub mod metrics;
pub mod service;
