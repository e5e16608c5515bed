//! Errors a user can act on: each says what went wrong and, where we know, what to do.

use thiserror::Error;

pub type Result<T> = std::result::Result<T, Error>;

#[derive(Debug, Error)]
pub enum Error {
    #[error("/dev/kvm does not exist: this host has no KVM. Load kvm_intel/kvm_amd (bare metal or a VM with nested virtualization), or run inside the nested lab (`tine lab -- ...`)")]
    NoKvm,
    #[error("permission denied opening /dev/kvm: run as root or add your user to the group owning /dev/kvm (usually `kvm`)")]
    KvmPermission,
    #[error("cannot open /dev/kvm: {0}")]
    KvmOpen(std::io::Error),
    #[error("KVM API version {0} is not supported (need 12)")]
    KvmApiVersion(i32),
    #[error("KVM lacks a required capability: {0}")]
    MissingCap(&'static str),
    #[error("{call} failed: {source}")]
    Kvm {
        call: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("guest memory: {0}")]
    Memory(String),
    #[error("kernel {path}: {reason}")]
    Kernel { path: String, reason: String },
    #[error("initramfs {path}: {reason}")]
    Initrd { path: String, reason: String },
    #[error("boot setup: {0}")]
    Boot(String),
    #[error("vCPU {index}: {reason}")]
    Vcpu { index: usize, reason: String },
    #[error("snapshot {0}")]
    Snapshot(String),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    pub fn kvm(call: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
        move |source| Error::Kvm { call, source }
    }
}
