//! The VM generation ID, as Linux's vmgenid driver (CONFIG_VMGENID) and Windows read it: 16
//! random bytes in guest memory, announced in the DSDT by device `VMGENCTR` whose `ADDR` holds
//! their address, plus an ACPI Generic Event Device whose interrupt tells the guest to read
//! them again. A restore makes a new VM instance, so it gets new bytes and the interrupt. A
//! kernel with the driver then reseeds its RNG on its own ("crng reseeded due to virtual
//! machine fork"), before any agent call.

use acpi_tables::{aml, Aml};
use kvm_ioctls::VmFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::error::{Error, Result};
use crate::layout::{GED_IRQ, VMGENID_ADDR};

/// The generation ID's size in bytes.
pub const SIZE: usize = 16;

/// The GED's interrupt line into the irqchip.
pub struct VmGenId {
    irq: EventFd,
}

impl VmGenId {
    /// Wires the GED's interrupt and writes a fresh generation ID.
    pub fn new(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<Self> {
        let irq = EventFd::new(EFD_NONBLOCK)?;
        vm.register_irqfd(&irq, GED_IRQ)
            .map_err(Error::kvm("KVM_IRQFD"))?;
        write_fresh(mem)?;
        Ok(VmGenId { irq })
    }

    /// Tells the guest its generation changed (after a restore, once the irqchip state is
    /// back: the interrupt waits in it until a vCPU runs).
    pub fn notify(&self) -> Result<()> {
        self.irq.write(1)?;
        Ok(())
    }
}

fn write_fresh(mem: &GuestMemoryMmap) -> Result<()> {
    let mut id = [0u8; SIZE];
    // SAFETY: getrandom writes at most `id.len()` bytes into `id`.
    let n = unsafe { libc::getrandom(id.as_mut_ptr().cast(), id.len(), 0) };
    if n != SIZE as isize {
        return Err(std::io::Error::last_os_error().into());
    }
    mem.write_slice(&id, GuestAddress(VMGENID_ADDR))
        .map_err(|e| {
            std::io::Error::other(format!(
                "writing the VM generation ID at {VMGENID_ADDR:#x}: {e}"
            ))
        })?;
    Ok(())
}

/// The DSDT's part: `\_SB.VGEN` (the ID's address) and `\_SB.GED0`, whose event method
/// notifies VGEN when its interrupt fires.
pub fn aml(out: &mut Vec<u8>) {
    let hid = aml::Name::new("_HID".into(), &"VMGENCTR");
    let cid = aml::Name::new("_CID".into(), &"VM_Gen_Counter");
    let ddn = aml::Name::new("_DDN".into(), &"VM_Gen_Counter");
    let (low, high) = (VMGENID_ADDR as u32, (VMGENID_ADDR >> 32) as u32);
    let addr = aml::Package::new(vec![&low, &high]);
    let addr = aml::Name::new("ADDR".into(), &addr);
    aml::Device::new("_SB_.VGEN".into(), vec![&hid, &cid, &ddn, &addr]).to_aml_bytes(out);

    let hid = aml::Name::new("_HID".into(), &"ACPI0013");
    let uid = aml::Name::new("_UID".into(), &aml::ZERO);
    let irq = aml::Interrupt::new(true, true, false, false, GED_IRQ);
    let crs = aml::ResourceTemplate::new(vec![&irq]);
    let crs = aml::Name::new("_CRS".into(), &crs);
    let vgen = aml::Path::new("\\_SB_.VGEN");
    // 0x80: the generation changed (the value Linux's and Windows' drivers wait for).
    let notify = aml::Notify::new(&vgen, &0x80u8);
    let is_ours = aml::Equal::new(&aml::Arg(0), &GED_IRQ);
    let on_ours = aml::If::new(&is_ours, vec![&notify]);
    let evt = aml::Method::new("_EVT".into(), 1, true, vec![&on_ours]);
    aml::Device::new("_SB_.GED0".into(), vec![&hid, &uid, &crs, &evt]).to_aml_bytes(out);
}

/// Reads the generation ID back (tests and diagnostics).
pub fn read(mem: &GuestMemoryMmap) -> Result<[u8; SIZE]> {
    let mut id = [0u8; SIZE];
    mem.read_slice(&mut id, GuestAddress(VMGENID_ADDR))
        .map_err(|e| std::io::Error::other(format!("reading the VM generation ID: {e}")))?;
    Ok(id)
}
