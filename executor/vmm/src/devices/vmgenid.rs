//! The VM generation ID, as Linux's vmgenid driver (CONFIG_VMGENID) and Windows read it: 16
//! random bytes in guest memory, announced in the DSDT by device `VMGENCTR` whose `ADDR` holds
//! their address, plus an ACPI Generic Event Device whose interrupt tells the guest to read
//! them again. A restore makes a new VM instance, so it gets new bytes and the interrupt. A
//! kernel with the driver then reseeds its RNG on its own ("crng reseeded due to virtual
//! machine fork"), before any agent call.
//!
//! The interrupt is raised only for a guest that has such a driver: the interrupt makes a
//! kernel without one run the GED's AML for nothing, several milliseconds of a child's first
//! run in the nested lab (docs/performance.md). A driver evaluates `ADDR` when it binds, and
//! `ADDR` is a method that writes to [`VMGENID_WATCH_PORT`] before it answers, so the VMM sees
//! the binding and the snapshot keeps it ([`Driver`]).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use acpi_tables::{aml, Aml};
use kvm_ioctls::VmFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::bus::PioDevice;
use super::GuestExit;
use crate::error::{Error, Result};
use crate::layout::{GED_IRQ, VMGENID_ADDR, VMGENID_WATCH_PORT};

/// The generation ID's size in bytes.
pub const SIZE: usize = 16;

/// What the VMM knows of the guest's generation-ID driver, as a snapshot keeps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driver {
    /// It bound (evaluated `ADDR`) in this VM or an ancestor: each restore raises the
    /// interrupt.
    Bound,
    /// Not bound since the guest booted with a watched `ADDR`: a restore writes a new ID (a
    /// driver binding later reads it) and raises nothing.
    NotBound,
    /// Unknown: the guest booted under a VMM that did not watch (its `ADDR` is a plain name).
    /// Raised at each restore, as it was then.
    Unknown,
}

impl Driver {
    /// As the snapshot header keeps it (`vmgenid_driver`): absent for [`Driver::Unknown`].
    pub fn to_header(self) -> Option<bool> {
        match self {
            Driver::Bound => Some(true),
            Driver::NotBound => Some(false),
            Driver::Unknown => None,
        }
    }

    pub fn from_header(bound: Option<bool>) -> Self {
        match bound {
            Some(true) => Driver::Bound,
            Some(false) => Driver::NotBound,
            None => Driver::Unknown,
        }
    }

    /// Whether a restore raises the GED's interrupt.
    pub fn raises(self) -> bool {
        self != Driver::NotBound
    }
}

/// The GED's interrupt line into the irqchip, and what is known of the guest's driver.
pub struct VmGenId {
    irq: EventFd,
    /// As the VM began (booted, or restored from its snapshot).
    driver: Driver,
    /// Set by [`Watch`] when the guest's `ADDR` runs in this VM.
    bound_here: Arc<AtomicBool>,
}

impl VmGenId {
    /// Wires the GED's interrupt and writes a fresh generation ID. `driver`: as the snapshot
    /// says ([`Driver::NotBound`] for a boot).
    pub fn new(vm: &VmFd, mem: &GuestMemoryMmap, driver: Driver) -> Result<Self> {
        let irq = EventFd::new(EFD_NONBLOCK)?;
        vm.register_irqfd(&irq, GED_IRQ)
            .map_err(Error::kvm("KVM_IRQFD"))?;
        write_fresh(mem)?;
        Ok(VmGenId {
            irq,
            driver,
            bound_here: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The device behind [`VMGENID_WATCH_PORT`] (the caller puts it on the port bus).
    pub fn watch(&self) -> Watch {
        Watch(self.bound_here.clone())
    }

    /// What a snapshot taken now keeps.
    pub fn driver(&self) -> Driver {
        if self.bound_here.load(Ordering::Acquire) {
            Driver::Bound
        } else {
            self.driver
        }
    }

    /// After a restore, once the irqchip state is back (the interrupt waits in it until a
    /// vCPU runs): tells the guest its generation changed, if it has a driver that listens.
    /// Returns whether it did.
    pub fn notify_restored(&self) -> Result<bool> {
        if !self.driver.raises() {
            return Ok(false);
        }
        self.irq.write(1)?;
        Ok(true)
    }
}

/// [`VMGENID_WATCH_PORT`]: a write means the guest's driver evaluated `ADDR`, i.e. bound.
/// Reads as 0. A guest can only make its own children's restores raise the interrupt by writing it.
pub struct Watch(Arc<AtomicBool>);

impl PioDevice for Watch {
    fn read(&mut self, _offset: u16, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _offset: u16, _data: &[u8]) -> Option<GuestExit> {
        if !self.0.swap(true, Ordering::AcqRel) {
            tracing::debug!("the guest's generation-ID driver bound");
        }
        None
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

/// The DSDT's part: `\_SB.VGEN` (the ID's address, from method `ADDR`, which first writes
/// to [`VMGENID_WATCH_PORT`]) and `\_SB.GED0`, whose event method notifies VGEN when its
/// interrupt fires.
pub fn aml(out: &mut Vec<u8>) {
    let hid = aml::Name::new("_HID".into(), &"VMGENCTR");
    let cid = aml::Name::new("_CID".into(), &"VM_Gen_Counter");
    let ddn = aml::Name::new("_DDN".into(), &"VM_Gen_Counter");
    let port = VMGENID_WATCH_PORT;
    let region = aml::OpRegion::new(
        "VGWP".into(),
        aml::OpRegionSpace::SystemIO,
        &port,
        &aml::ONE,
    );
    let field = aml::Field::new(
        "VGWP".into(),
        aml::FieldAccessType::Byte,
        aml::FieldLockRule::NoLock,
        aml::FieldUpdateRule::Preserve,
        vec![aml::FieldEntry::Named(*b"VGWB", 8)],
    );
    let (low, high) = (VMGENID_ADDR as u32, (VMGENID_ADDR >> 32) as u32);
    let addr = aml::Package::new(vec![&low, &high]);
    let watch = aml::Path::new("VGWB");
    let mark = aml::Store::new(&watch, &aml::ONE);
    let answer = aml::Return::new(&addr);
    let addr = aml::Method::new("ADDR".into(), 0, true, vec![&mark, &answer]);
    aml::Device::new(
        "_SB_.VGEN".into(),
        vec![&hid, &cid, &ddn, &region, &field, &addr],
    )
    .to_aml_bytes(out);

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_keeps_the_record_and_only_a_known_absence_skips_the_interrupt() {
        for d in [Driver::Bound, Driver::NotBound, Driver::Unknown] {
            assert_eq!(Driver::from_header(d.to_header()), d);
        }
        assert!(Driver::Bound.raises());
        assert!(
            Driver::Unknown.raises(),
            "older snapshots keep their interrupt"
        );
        assert!(!Driver::NotBound.raises());
    }

    #[test]
    fn any_write_to_the_watch_port_records_a_binding() {
        let seen = Arc::new(AtomicBool::new(false));
        let mut w = Watch(seen.clone());
        let mut b = [0xffu8];
        w.read(0, &mut b);
        assert_eq!(b, [0]);
        assert!(!seen.load(Ordering::Acquire), "a read is not a binding");
        assert_eq!(w.write(0, &[0]), None);
        assert!(seen.load(Ordering::Acquire));
    }

    #[test]
    fn addr_is_a_method_that_writes_the_watch_port() {
        let mut out = Vec::new();
        aml(&mut out);
        let has = |needle: &[u8]| out.windows(needle.len()).any(|w| w == needle);
        // OperationRegion (VGWP, SystemIO, WordConst VMGENID_WATCH_PORT, One).
        let mut region = vec![0x5b, 0x80];
        region.extend_from_slice(b"VGWP");
        region.extend_from_slice(&[0x01, 0x0b]);
        region.extend_from_slice(&VMGENID_WATCH_PORT.to_le_bytes());
        region.push(0x01);
        assert!(has(&region), "no I/O region at the watch port");
        // Method (ADDR, 0, Serialized) { Store (One, VGWB) ... }: a method, not a name.
        let at = out
            .windows(4)
            .position(|w| w == b"ADDR")
            .expect("ADDR is defined");
        assert_eq!(out[at - 2], 0x14, "ADDR is a method");
        assert_eq!(&out[at + 5..at + 11], &[0x70, 0x01, b'V', b'G', b'W', b'B']);
        assert!(has(&(VMGENID_ADDR as u32).to_le_bytes()));
    }
}
