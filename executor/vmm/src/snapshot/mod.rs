//! VM snapshots: the complete machine state at one instant (vCPUs, in-kernel irqchip, PIT and
//! clock, devices) plus the guest memory image, written atomically into a directory.
//!
//! Layout of a snapshot directory:
//! * `snapshot.json` — self-describing header: format version, host CPU and kernel, sizes, and
//!   the SHA-256 of `state.bin`;
//! * `state.bin` — the machine state (bincode);
//! * `memory.img` — guest RAM, byte for byte (sparse where the guest never wrote), which
//!   children map `MAP_PRIVATE`;
//! * or, for a diff over a parent snapshot in a sibling directory (see [`diff`]), `pages.bin`
//!   and `pages.idx`: only the pages written since the parent.

pub mod devices;
pub mod diff;
pub mod file;
pub mod host_id;
pub mod live_copy;
pub mod vcpu;

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, kvm_pit_state2, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// In-kernel VM devices: PIT, kvmclock, PIC pair and IOAPIC.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmKvmState {
    pub pit: kvm_pit_state2,
    pub clock: kvm_clock_data,
    pub pic_master: kvm_irqchip,
    pub pic_slave: kvm_irqchip,
    pub ioapic: kvm_irqchip,
}

fn irqchip(vm: &VmFd, chip_id: u32) -> Result<kvm_irqchip> {
    let mut c = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut c)
        .map_err(Error::kvm("KVM_GET_IRQCHIP"))?;
    Ok(c)
}

pub fn save_vm(vm: &VmFd) -> Result<VmKvmState> {
    Ok(VmKvmState {
        pit: vm.get_pit2().map_err(Error::kvm("KVM_GET_PIT2"))?,
        clock: vm.get_clock().map_err(Error::kvm("KVM_GET_CLOCK"))?,
        pic_master: irqchip(vm, KVM_IRQCHIP_PIC_MASTER)?,
        pic_slave: irqchip(vm, KVM_IRQCHIP_PIC_SLAVE)?,
        ioapic: irqchip(vm, KVM_IRQCHIP_IOAPIC)?,
    })
}

/// Restore after the vCPUs: PIT2 → CLOCK → PIC master → PIC slave → IOAPIC.
pub fn restore_vm(vm: &VmFd, s: &VmKvmState) -> Result<()> {
    vm.set_pit2(&s.pit).map_err(Error::kvm("KVM_SET_PIT2"))?;
    // flags = 0: KVM_CLOCK_REALTIME would make guest monotonic time jump; the agent fixes the
    // wall clock after restore instead.
    let clock = kvm_clock_data {
        clock: s.clock.clock,
        flags: 0,
        ..Default::default()
    };
    vm.set_clock(&clock).map_err(Error::kvm("KVM_SET_CLOCK"))?;
    for chip in [&s.pic_master, &s.pic_slave, &s.ioapic] {
        vm.set_irqchip(chip)
            .map_err(Error::kvm("KVM_SET_IRQCHIP"))?;
    }
    Ok(())
}

/// Everything but memory.
#[derive(Serialize, Deserialize)]
pub struct MachineState {
    pub vcpus: Vec<vcpu::VcpuState>,
    pub vm: VmKvmState,
    pub serial: devices::SerialSnapshot,
    pub virtio: Vec<devices::VirtioMmioSnapshot>,
    pub mem_size: u64,
    /// Set when the guest's tables announce a VM generation ID (devices::vmgenid): a restore
    /// gives it a new one, and raises its interrupt as the driver's record says. Kept in the
    /// header (`SnapshotHeader::vmgenid`, `vmgenid_driver`), so that the state's encoding stays
    /// the one older snapshots have.
    #[serde(skip)]
    pub vmgenid: Option<crate::devices::vmgenid::Driver>,
}
