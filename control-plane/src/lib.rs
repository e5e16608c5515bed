//! Tine's control plane: a stateless gRPC service over SQLite. It records snapshot lineage,
//! executors and sandboxes, places fan-out spawns on executors, and authenticates, audits and
//! measures every call.

pub mod api;
pub mod audit;
pub mod calls;
pub mod db;
pub mod executors;
pub mod hop;
pub mod lock_wait;
pub mod metrics;
pub mod paging;
pub mod scheduler;
pub mod server;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
