//! Library error type. Every variant carries enough context (which digest,
//! which path, which tag) to act on the message without a debugger.

use std::path::PathBuf;
use std::time::Duration;

use crate::digest::Digest;

pub type Result<T, E = StoreError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{context}: {path}: {source}")]
    Io {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid tag {tag:?}: {reason}")]
    InvalidTag { tag: String, reason: &'static str },
    #[error("invalid digest {text:?}: {reason}")]
    InvalidDigest { text: String, reason: &'static str },
    #[error("unknown tag {0:?}")]
    UnknownTag(String),
    #[error("layer {0} is not in the local cache")]
    LayerNotCached(Digest),
    #[error("object {0} is not in the local cache")]
    ObjectNotCached(Digest),
    #[error("layer {digest} is corrupt: {reason}")]
    CorruptLayer { digest: Digest, reason: String },
    #[error("object {digest} failed verification: {reason}")]
    CorruptObject { digest: Digest, reason: String },
    #[error("invalid memory input: {0}")]
    InvalidInput(String),
    #[error("pack refused: {0}")]
    PackRefused(String),
    #[error("pack signature: {0}")]
    Signature(String),
    #[error("remote store {op} {key}: {source}")]
    Remote {
        op: &'static str,
        key: String,
        #[source]
        source: object_store::Error,
    },
    /// The store could not be reached: transient failures (connection refused,
    /// timeouts, 5xx, a store directory that is gone) outlasted the retry
    /// policy. Worth retrying later; the request itself was fine.
    #[error("store {store} is unavailable: {what} gave up after {attempts} attempt(s) in {elapsed:.1?}: {reason}")]
    Unavailable {
        /// [`crate::remote::RemoteStore::description`]
        store: String,
        /// Operation and key, e.g. `get layers/<hex>`.
        what: String,
        attempts: u32,
        elapsed: Duration,
        /// The last failure.
        reason: String,
    },
    #[error("remote store configuration: {0}")]
    RemoteConfig(String),
    #[error("remote object {key} is {size} bytes, more than the {max} it may be: refused unread")]
    TooLarge { key: String, size: u64, max: u64 },
    #[error("layer {0} not found in the remote store")]
    RemoteLayerMissing(Digest),
    #[error("garbage collection: {0}")]
    Gc(String),
}

impl StoreError {
    /// True when the store could not be reached (see [`StoreError::Unavailable`]):
    /// callers map it to "try again later" (gRPC UNAVAILABLE), never to "bad
    /// request" or "data corrupt".
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }

    pub(crate) fn io(
        context: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| StoreError::Io {
            context,
            path,
            source,
        }
    }
}
