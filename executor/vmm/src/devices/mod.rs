//! Emulated devices and the port-I/O bus that routes vCPU exits to them.

pub mod bus;
pub mod mmio;
pub mod power;
pub mod serial;
pub mod virtio;
pub mod vmgenid;

/// Why the guest stopped on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GuestExit {
    /// ACPI S5 (e.g. `poweroff -f`).
    PowerOff,
    /// ACPI reset register or the i8042 reset line (e.g. `reboot -f`, or `panic=-1`).
    Reboot,
    /// The vCPU hit a triple fault (KVM_EXIT_SHUTDOWN): the guest crashed.
    TripleFault,
}

impl GuestExit {
    /// Process exit status that reflects how the guest ended.
    pub fn exit_code(self) -> i32 {
        match self {
            GuestExit::PowerOff => 0,
            GuestExit::Reboot => 2,
            GuestExit::TripleFault => 3,
        }
    }
}
