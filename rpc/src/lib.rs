//! What Tine's gRPC services (control plane, executor) and clients share: bearer tokens and
//! roles, TLS and listener safety checks, logs and traces, input validation with validated
//! names, and gRPC status codes by name. The executor links this, never the control plane.

pub mod auth;
pub mod conn;
pub mod gate;
pub mod metrics;
pub mod status;
pub mod telemetry;
pub mod tls;
pub mod validate;

pub use tine_proto::limits;
pub use tine_proto::names::{ExecutorId, NameError, SandboxId, Tag};
