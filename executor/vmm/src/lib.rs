//! Tine's virtual machine monitor, built on the rust-vmm crates: KVM VM and vCPUs, guest RAM
//! that can be shared or mapped copy-on-write, Linux boot (PVH and the 64-bit boot protocol),
//! ACPI tables, a serial console and power management.

pub mod acpi;
pub mod boot;
pub mod cpuid;
pub mod devices;
pub mod diagnostics;
pub mod error;
pub mod host;
pub mod kvm_stats;
pub mod layout;
pub mod memory;
pub mod regs;
pub mod snapshot;
pub mod vcpu;
pub mod vm;

pub use devices::GuestExit;
pub use error::{Error, Result};
pub use memory::{GuestRam, Sharing};
pub use vm::{LinuxBoot, NotifyPath, Vm, VmOptions, DEFAULT_CMDLINE, MAX_VCPUS};
