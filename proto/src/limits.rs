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

/// Most vCPUs a parent VM may have.
pub const MAX_VCPUS: u32 = 64;

/// Guest memory a parent VM may be given (MiB): enough for a kernel and the agent, and at
/// most 256 GiB.
pub const MIN_GUEST_MEM_MIB: u64 = 64;
pub const MAX_GUEST_MEM_MIB: u64 = 256 << 10;

/// Most warm-up snippets one CreateSnapshot may carry.
pub const MAX_WARMUP_EVALS: usize = 64;

/// The smallest memory limit a child may be given (MiB): its VMM's own memory, the page
/// tables KVM keeps for it, and what the guest writes while it is made ready.
pub const MIN_MEMORY_LIMIT_MIB: u64 = 64;

/// The largest memory limit a spawn may name (MiB): 16 TiB, past any host.
pub const MAX_MEMORY_LIMIT_MIB: u64 = 16 << 20;

/// The smallest CPU share (thousandths of a core): below 1% a child cannot answer in time.
pub const MIN_CPU_MILLIS: u32 = 10;

/// The largest CPU share a spawn may name: 1024 cores. An executor refuses more than it has.
pub const MAX_CPU_MILLIS: u32 = 1024 * 1000;
