//! Library error type. Every variant carries enough context (which digest,
//! which path, which tag) to act on the message without a debugger.

use std::path::PathBuf;

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
    #[error("remote store configuration: {0}")]
    RemoteConfig(String),
    #[error("layer {0} not found in the remote store")]
    RemoteLayerMissing(Digest),
    #[error("garbage collection: {0}")]
    Gc(String),
}

impl StoreError {
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
