//! Errors a user can act on: each says what went wrong with the values involved (paths, sizes,
//! indices, versions) and, where we know, what to do.
//!
//! [`Error`] is what every fallible VMM call returns. KVM and plain I/O failures are its own
//! variants; everything else is one enum per stage, so callers that care can match on the
//! stage and the cause: [`ConfigError`], [`MemoryError`], [`BootError`], [`VcpuError`],
//! [`DeviceError`], [`SnapshotError`] (taking a snapshot) and [`RestoreError`] (reading one).
//!
//! Messages include the underlying error's text as well as exposing it as `source()`: callers
//! across the workspace show errors with plain `to_string()` (gRPC statuses), which must not
//! lose the cause.

use std::path::PathBuf;

use thiserror::Error;

use crate::snapshot::devices::VirtioKind;
use crate::snapshot::host_id::HostIdentity;

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
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Memory(#[from] MemoryError),
    #[error(transparent)]
    Boot(#[from] BootError),
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    #[error(transparent)]
    Restore(#[from] RestoreError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// The VM is stopping (or stopped while being paused): what was asked of it no longer
    /// matters.
    pub fn is_stopping(&self) -> bool {
        matches!(
            self,
            Error::Vcpu(VcpuError::Stopping | VcpuError::StoppedWhilePausing { .. })
        )
    }

    pub fn kvm(call: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
        move |source| Error::Kvm { call, source }
    }
}

/// A VM shape we refuse before touching KVM.
#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("invalid configuration: {requested} vCPUs requested: use 1..={max}")]
    VcpuCount { requested: usize, max: u8 },
    #[error(
        "invalid configuration: {requested} vCPUs requested but this host's KVM allows {host_max}"
    )]
    VcpusOverHostLimit { requested: u8, host_max: usize },
    #[error("invalid configuration: memory size {mib} MiB is out of range: use {min}..={max} MiB")]
    MemorySize { mib: u64, min: u64, max: u64 },
}

/// Creating or mapping guest RAM.
#[derive(Debug, Error)]
pub enum MemoryError {
    #[error("guest memory: {size:#x} bytes is not a whole number of pages")]
    AnonymousSize { size: u64 },
    #[error("guest memory: memfd_create failed: {source}")]
    Memfd {
        #[source]
        source: std::io::Error,
    },
    #[error("guest memory: cannot size guest RAM to {mib} MiB: {source}")]
    Resize {
        mib: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("guest memory: cannot stat memory image: {source}")]
    StatImage {
        #[source]
        source: std::io::Error,
    },
    #[error("guest memory: memory image is {actual} bytes, expected {expected}: truncated or wrong file")]
    ImageSize { expected: u64, actual: u64 },
    #[error("guest memory: cannot map {size:#x} bytes of guest RAM at {guest_addr:#x}: {source}")]
    Map {
        guest_addr: u64,
        size: u64,
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    #[error("guest memory: region at {guest_addr:#x} (+{size:#x}) overflows the address space")]
    RegionOverflow { guest_addr: u64, size: u64 },
    #[error("guest memory: bad guest RAM layout: {source}")]
    Layout {
        #[source]
        source: vm_memory::GuestRegionCollectionError,
    },
    #[error("guest memory: RAM range at {guest_addr:#x} is not mapped")]
    NotMapped { guest_addr: u64 },
    #[error("guest memory: a diff layer's pages at image offset {offset:#x} (+{len:#x}) are not inside one RAM range")]
    OverlayOutside { offset: u64, len: u64 },
    #[error("guest memory: cannot map a diff layer's pages at image offset {offset:#x} (+{len:#x}): {source}")]
    Overlay {
        offset: u64,
        len: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("guest memory: {advice} refused for guest RAM at {guest_addr:#x}: {source}")]
    Advise {
        advice: &'static str,
        guest_addr: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("guest memory: giving back unchanged pages: {step}: {source}")]
    GiveBack {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("guest memory: no host address for guest RAM at {guest_addr:#x}: {source}")]
    HostAddress {
        guest_addr: u64,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// Loading the kernel, initramfs and command line, and writing the boot structures.
#[derive(Debug, Error)]
pub enum BootError {
    #[error("kernel {}: {source}", .path.display())]
    KernelRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("kernel {}: not a Linux kernel (neither an ELF vmlinux nor a bzImage with a \"HdrS\" header)", .path.display())]
    NotAKernel { path: PathBuf },
    #[error("kernel {}: cannot load {format}: {source}", .path.display())]
    KernelLoad {
        path: PathBuf,
        /// "ELF" or "bzImage".
        format: &'static str,
        #[source]
        source: linux_loader::loader::Error,
    },
    #[error("kernel {}: kernel does not fit in guest RAM (it ends at {kernel_end:#x}, RAM below the MMIO gap ends at {ram_end:#x}): give the VM more memory", .path.display())]
    KernelTooBig {
        path: PathBuf,
        kernel_end: u64,
        ram_end: u64,
    },
    #[error("initramfs {}: {source}", .path.display())]
    InitrdRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("initramfs {}: file is empty", .path.display())]
    InitrdEmpty { path: PathBuf },
    #[error("initramfs {}: {} MiB does not fit in guest RAM below {} MiB above the kernel (which ends at {kernel_end:#x}): give the VM more memory", .path.display(), .size >> 20, .ram_end >> 20)]
    InitrdTooBig {
        path: PathBuf,
        size: u64,
        kernel_end: u64,
        ram_end: u64,
    },
    #[error("initramfs {}: cannot read into guest RAM at {addr:#x}: {source}", .path.display())]
    InitrdLoad {
        path: PathBuf,
        addr: u64,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    #[error("kernel command line ({len} bytes, at most {max}): {source}")]
    Cmdline {
        len: usize,
        max: usize,
        #[source]
        source: linux_loader::cmdline::Error,
    },
    #[error("boot setup: writing the kernel command line: {source}")]
    CmdlineWrite {
        #[source]
        source: linux_loader::loader::Error,
    },
    #[error("boot setup: writing PVH start info: {source}")]
    PvhStartInfo {
        #[source]
        source: linux_loader::configurator::Error,
    },
    #[error("boot setup: writing zero page: {source}")]
    ZeroPage {
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    #[error("boot setup: {entries} e820 entries but the zero page holds {max}")]
    TooManyE820 { entries: usize, max: usize },
    #[error("boot setup: ACPI tables do not fit below 1 MiB: the {table} would end at {end:#x}, past {limit:#x}")]
    AcpiTooBig {
        table: &'static str,
        end: u64,
        limit: u64,
    },
    #[error("boot setup: writing ACPI {table} at {addr:#x}: {source}")]
    AcpiWrite {
        table: &'static str,
        addr: u64,
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    #[error("boot setup: writing boot tables: {source}")]
    BootTables {
        #[source]
        source: vm_memory::GuestMemoryError,
    },
}

/// Setting up, running, saving or restoring one vCPU.
#[derive(Debug, Error)]
pub enum VcpuError {
    #[error("vCPU {index}: {call}: {source}")]
    Ioctl {
        index: usize,
        call: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("vCPU {index}: {what} does not fit a KVM list: {source}")]
    List {
        index: usize,
        /// "MSR list" or "CPUID".
        what: &'static str,
        #[source]
        source: vmm_sys_util::fam::Error,
    },
    #[error("vCPU {index}: KVM_SET_MSRS set only {set} of {total} {which} MSRs (first refused: {refused:#x})")]
    MsrsRefused {
        index: usize,
        /// "boot" or "saved".
        which: &'static str,
        set: usize,
        total: usize,
        refused: u32,
    },
    #[error("vCPU {index}: unknown system event {event}")]
    UnknownSystemEvent { index: usize, event: u32 },
    #[error("vCPU {index}: KVM_RUN entry failed: hardware reason {reason:#x} on host CPU {cpu}")]
    EntryFailed { index: usize, reason: u64, cpu: u32 },
    #[error("vCPU {index}: KVM internal error (emulation failure?) at rip {rip:#x}")]
    Internal { index: usize, rip: u64 },
    #[error("vCPU {index}: unexpected exit {exit}")]
    UnexpectedExit { index: usize, exit: String },
    #[error("cannot install vCPU kick handler (signal {signal}): {source}")]
    KickHandler {
        signal: i32,
        #[source]
        source: vmm_sys_util::errno::Error,
    },
    #[error("the guest stopped while being paused (vCPU {index} exited)")]
    StoppedWhilePausing { index: usize },
    #[error("no vCPU reported an outcome")]
    NoOutcome,
    #[error("the VM is stopping: it cannot be paused")]
    Stopping,
}

impl VcpuError {
    /// Context for a failed ioctl on vCPU `index`.
    pub fn ioctl(index: usize, call: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VcpuError {
        move |source| VcpuError::Ioctl {
            index,
            call,
            source,
        }
    }
}

/// Wiring devices to the buses, and device state.
#[derive(Debug, Error)]
pub enum DeviceError {
    #[error("device setup: port range {base:#x}+{len} overlaps {other_base:#x}+{other_len}")]
    PortOverlap {
        base: u16,
        len: u16,
        other_base: u16,
        other_len: u16,
    },
    #[error("device setup: bad MMIO window {base:#x}+{size:#x}")]
    MmioWindow { base: u64, size: u64 },
    #[error("device setup: a device wired for the MMIO window at {wired:#x} was attached where the next free one is {next:#x}")]
    SlotOutOfOrder { wired: u64, next: u64 },
    #[error(
        "device setup: MMIO window {base:#x}+{size:#x} overlaps {other_base:#x}+{other_size:#x}"
    )]
    MmioOverlap {
        base: u64,
        size: u64,
        other_base: u64,
        other_size: u64,
    },
    #[error(
        "serial: cannot restore the saved UART state ({fifo} bytes in its input FIFO): {source}"
    )]
    SerialState {
        fifo: usize,
        #[source]
        source: vm_superio::serial::Error<std::io::Error>,
    },
    #[error("virtio device mismatch: the VM has {device:?} with {device_queues} queues, the snapshot has {snapshot:?} with {snapshot_queues}")]
    VirtioMismatch {
        device: VirtioKind,
        device_queues: usize,
        snapshot: VirtioKind,
        snapshot_queues: usize,
    },
    #[error("virtio {kind:?}: bad queue {index} in snapshot: {source}")]
    VirtioQueue {
        kind: VirtioKind,
        index: usize,
        #[source]
        source: virtio_queue::Error,
    },
    #[error("vsock: guest CID {cid} is reserved or out of range (use 3..={max})")]
    VsockCid { cid: u64, max: u64 },
    #[error("vsock socket {}: {source}", .path.display())]
    VsockSocket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("vsock: cannot start the device thread: {source}")]
    VsockThread {
        #[source]
        source: std::io::Error,
    },
    #[error("net: cannot start the device thread: {source}")]
    NetThread {
        #[source]
        source: std::io::Error,
    },
}

/// Taking a snapshot and writing it to disk.
#[derive(Debug, Error)]
pub enum SnapshotError {
    #[error("snapshot {}: already exists", .dir.display())]
    AlreadyExists { dir: PathBuf },
    #[error("snapshot {}: not a directory name", .dir.display())]
    NotADirName { dir: PathBuf },
    #[error("snapshot {}: vCPU {index} did not save its state", .dir.display())]
    VcpuNotSaved { dir: PathBuf, index: usize },
    #[error("snapshot {}: encoding the machine state: {source}", .dir.display())]
    EncodeState {
        dir: PathBuf,
        #[source]
        source: bincode::Error,
    },
    #[error("snapshot {}: encoding the header: {source}", .dir.display())]
    EncodeHeader {
        dir: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("snapshot {}: guest RAM has no backing file (a child restored page by page cannot be snapshotted yet)", .dir.display())]
    NoMemoryFile { dir: PathBuf },
    #[error("snapshot {}: a diff needs a VM restored from a snapshot (this one was booted or restored page by page): take a full snapshot", .dir.display())]
    NoParent { dir: PathBuf },
    #[error("snapshot {}: every snapshot this VM's memory is a diff over was deleted or replaced since: take a full snapshot", .dir.display())]
    BaseGone { dir: PathBuf },
    #[error("snapshot {}: a diff must sit beside its parent {}", .dir.display(), .parent.display())]
    ParentNotSibling { dir: PathBuf, parent: PathBuf },
    #[error("snapshot {}: not taken as this VM's new diff base: {reason}", .dir.display())]
    Rebase { dir: PathBuf, reason: String },
    #[error("snapshot {}: copying the guest's memory from a fork of the VMM: {source}", .dir.display())]
    LiveCopy {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("snapshot {}: reading which pages the guest wrote: {source}", .dir.display())]
    Pagemap {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("snapshot: writing {}: {source}", .path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Reading and checking a snapshot directory before anything is restored.
#[derive(Debug, Error)]
pub enum RestoreError {
    #[error("snapshot: no readable {}: {source}", .path.display())]
    Unreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("snapshot: {} is corrupt: {source}", .path.display())]
    CorruptHeader {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("snapshot: {} describes format {found:?}, not {expected:?}: not a Tine VM snapshot", .path.display())]
    NotASnapshot {
        path: PathBuf,
        found: String,
        expected: &'static str,
    },
    #[error("snapshot: {} is format version {found}, this build reads version {supported}: take the snapshot again with this build", .path.display())]
    Version {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("snapshot {}: {source}", .dir.display())]
    Host {
        dir: PathBuf,
        #[source]
        source: HostMismatch,
    },
    #[error("snapshot: {} is {actual} bytes, header says {expected}: truncated or replaced", .path.display())]
    StateSize {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("snapshot: {} checksum mismatch (SHA-256 {actual}, header says {expected}): the file is corrupted", .path.display())]
    Checksum {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("snapshot: {} does not decode: {source}", .path.display())]
    Decode {
        path: PathBuf,
        #[source]
        source: bincode::Error,
    },
    #[error("snapshot {}: header and state disagree: header says {header_vcpus} vCPUs and {header_mem} bytes of RAM, the state has {state_vcpus} and {state_mem}", .dir.display())]
    HeaderStateMismatch {
        dir: PathBuf,
        header_vcpus: u32,
        state_vcpus: usize,
        header_mem: u64,
        state_mem: u64,
    },
    #[error("snapshot: {} is {actual} bytes, expected {expected}: truncated", .path.display())]
    MemoryTruncated {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("snapshot: {} is {actual} bytes but the header says {expected}: not this snapshot's memory image", .path.display())]
    MemorySize {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("snapshot {}: has a vsock device: give it a host socket path", .dir.display())]
    NoVsockSocket { dir: PathBuf },
    #[error("snapshot {}: its chain is deeper than {max} layers (a loop?)", .dir.display())]
    ChainTooDeep { dir: PathBuf, max: usize },
    #[error("snapshot {}: parent name {name:?} is not a sibling directory name", .dir.display())]
    BadParentName { dir: PathBuf, name: String },
    #[error("snapshot {}: its parent {} changed since the diff was taken (state SHA-256 {actual}, the diff was taken over {expected}): the diff no longer applies", .dir.display(), .parent.display())]
    ParentChanged {
        dir: PathBuf,
        parent: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("snapshot {}: parent {} has {actual} bytes of RAM, the diff {expected}", .dir.display(), .parent.display())]
    ParentSize {
        dir: PathBuf,
        parent: PathBuf,
        expected: u64,
        actual: u64,
    },
    #[error("snapshot: {} is corrupt: {reason}", .path.display())]
    BadIndex { path: PathBuf, reason: String },
}

/// Why a snapshot taken on one host cannot be restored on this one.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum HostMismatch {
    #[error("snapshot was taken on CPU {} \"{}\" (signature {:#x}) but this host has {} \"{}\" ({:#x}); vCPU state only restores on the same CPU model",
        .snapshot.cpu_vendor, .snapshot.cpu_model_name, .snapshot.cpu_signature,
        .here.cpu_vendor, .here.cpu_model_name, .here.cpu_signature)]
    Cpu {
        snapshot: Box<HostIdentity>,
        here: Box<HostIdentity>,
    },
    #[error("snapshot was taken under host kernel {snapshot} but this host runs {here}; KVM state is only restored across the same major.minor kernel")]
    Kernel { snapshot: String, here: String },
}
