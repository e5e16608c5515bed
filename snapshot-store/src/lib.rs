//! Tine's snapshot store: layered, content-addressed, zstd-compressed guest
//! memory snapshots that stack cheaply and move between hosts.
//!
//! See `docs/snapshot-store.md` for the format and the design reasons.

pub mod digest;
pub mod error;
pub mod fsutil;
pub mod manifest;
pub mod tag;

pub use digest::Digest;
pub use error::{Result, StoreError};
pub use manifest::{Layer, PageSource};
pub mod assemble;
pub mod builder;
pub mod cache;
pub mod cli;
pub mod gc;
pub mod keys;
pub mod pack;
pub mod progress;
pub mod remote;
pub mod retry;
