//! Limits both sides of an API must agree on, defined once.

/// Most children one spawn (a Spawn RPC or `tine fork`) may ask for.
pub const MAX_SPAWN: u32 = 1000;

/// Largest gRPC message accepted or sent (file chunks are 1 MiB).
pub const MAX_MESSAGE_BYTES: usize = 8 << 20;

/// Per-child readiness deadline when a spawn does not give one.
pub const DEFAULT_READY_TIMEOUT_MS: u32 = 120_000;

/// Longest readiness deadline a spawn may ask for: a child that is not ready after this is
/// broken, not slow, and must not hold a slot.
pub const MAX_READY_TIMEOUT_MS: u32 = 900_000;
