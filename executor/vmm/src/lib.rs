//! Tine's virtual machine monitor, built on the rust-vmm crates: KVM VM and vCPUs, guest RAM
//! that can be shared or mapped copy-on-write, Linux boot (PVH and the 64-bit boot protocol),
//! ACPI tables, a serial console and power management.

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod devices;
pub mod diagnostics;
pub mod error;
pub mod give_back;
pub mod host;
pub mod kvm_stats;
pub mod layout;
pub mod marks;
pub mod memory;
pub mod prefault;
pub mod regs;
pub mod snapshot;
pub mod vcpu;
pub mod vm;

pub use devices::GuestExit;

/// Stack size of every thread a VMM starts (vCPUs, device threads): far
/// more than they use, and below 2 MiB on purpose. Rust's default of exactly 2 MiB lets the
/// kernel place a stack on a 2 MiB boundary (as it does next to a huge-page mapping of guest
/// RAM, and for every such mapping on Linux 6.7+); with transparent huge pages `always` the
/// first touch then takes a whole 2 MiB huge page: 2 MiB per thread, per child.
pub const THREAD_STACK_BYTES: usize = 1 << 20;

/// A thread builder for a VMM thread named `name`, with [`THREAD_STACK_BYTES`] of stack.
pub fn thread_builder(name: impl Into<String>) -> std::thread::Builder {
    std::thread::Builder::new()
        .name(name.into())
        .stack_size(THREAD_STACK_BYTES)
}
pub use error::{Error, Result};
pub use memory::{GuestRam, Sharing};
pub use vm::{LinuxBoot, NotifyPath, Vm, VmOptions, DEFAULT_CMDLINE, MAX_VCPUS};
