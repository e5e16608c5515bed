//! ACPI tables: RSDP → XSDT → {FADT (hardware-reduced) → DSDT, MADT}.
//!
//! Stock Debian kernels take their CPUs from the MADT and their devices (serial, and
//! virtio-mmio windows, `LNRO0005`) from the DSDT; they cannot take virtio-mmio devices from the
//! command line. Power-off and reset go through the FADT's sleep-control and reset registers,
//! which the VMM traps as port I/O.

use acpi_tables::{aml, fadt, madt, rsdp::Rsdp, sdt::Sdt, xsdt::XSDT, Aml};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::error::{BootError, ConfigError, Result};
use crate::layout::*;

const OEM_ID: [u8; 6] = *b"TINE  ";
const OEM_TABLE_ID: [u8; 8] = *b"TINEVMM ";
const OEM_REVISION: u32 = 1;

/// A virtio-mmio device the guest should discover: its MMIO window and its interrupt line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VirtioMmioSlot {
    pub base: u64,
    pub size: u64,
    pub irq: u32,
}

/// Everything the tables describe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcpiConfig {
    pub vcpus: u8,
    pub virtio: Vec<VirtioMmioSlot>,
    /// Announce the VM generation ID and its Generic Event Device (devices::vmgenid).
    pub vmgenid: bool,
}

fn dsdt(cfg: &AcpiConfig) -> Vec<u8> {
    let mut body: Vec<u8> = Vec::new();

    // \_S5_: SLP_TYPa/SLP_TYPb written to the sleep-control register on power-off.
    let s5 = aml::Package::new(vec![
        &ACPI_S5_SLEEP_TYPE,
        &ACPI_S5_SLEEP_TYPE,
        &aml::ZERO,
        &aml::ZERO,
    ]);
    aml::Name::new("_S5_".into(), &s5).to_aml_bytes(&mut body);

    // COM1, so the 8250 driver binds through ACPI with the right interrupt.
    let com1_io = aml::IO::new(COM1_PORT, COM1_PORT, 1, 8);
    let com1_irq = aml::Interrupt::new(true, true, false, false, COM1_IRQ);
    let com1_crs = aml::ResourceTemplate::new(vec![&com1_io, &com1_irq]);
    let com1_hid = aml::EISAName::new("PNP0501");
    device(&mut body, "_SB_.COM1", &com1_hid, &aml::ZERO, &com1_crs);

    for (i, slot) in cfg.virtio.iter().enumerate() {
        let name = format!("_SB_.V{i:03X}");
        let window = aml::Memory32Fixed::new(true, slot.base as u32, slot.size as u32);
        let irq = aml::Interrupt::new(true, true, false, false, slot.irq);
        let crs = aml::ResourceTemplate::new(vec![&window, &irq]);
        let hid: aml::AmlStr = "LNRO0005";
        device(&mut body, &name, &hid, &i, &crs);
    }

    if cfg.vmgenid {
        crate::devices::vmgenid::aml(&mut body);
    }

    let mut table = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    table.append_slice(&body);
    table.as_slice().to_vec()
}

/// Append `Device(path) { _HID, _UID, _CRS }`.
fn device(out: &mut Vec<u8>, path: &str, hid: &dyn Aml, uid: &dyn Aml, crs: &dyn Aml) {
    let hid = aml::Name::new("_HID".into(), hid);
    let uid = aml::Name::new("_UID".into(), uid);
    let crs = aml::Name::new("_CRS".into(), crs);
    aml::Device::new(path.into(), vec![&hid, &uid, &crs]).to_aml_bytes(out);
}

fn fadt(dsdt_addr: u64) -> Vec<u8> {
    use acpi_tables::gas::{AccessSize, AddressSpace, GAS};
    let io_reg = |port: u16| {
        GAS::new(
            AddressSpace::SystemIo,
            8,
            0,
            AccessSize::ByteAccess,
            port as u64,
        )
    };
    let mut b = fadt::FADTBuilder::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION)
        .dsdt_64(dsdt_addr)
        .flag(fadt::Flags::HwReducedAcpi)
        .flag(fadt::Flags::PwrButton)
        .flag(fadt::Flags::SlpButton)
        .flag(fadt::Flags::ResetRegSup);
    b.sleep_control_reg = io_reg(ACPI_SLEEP_CONTROL_PORT);
    b.sleep_status_reg = io_reg(ACPI_SLEEP_STATUS_PORT);
    b.reset_reg = io_reg(ACPI_RESET_PORT);
    b.reset_value = ACPI_RESET_VALUE;
    // IA-PC boot architecture: no VGA, no MSI (no PCI), no CMOS RTC.
    b.iapc_boot_arch = ((1u16 << 2) | (1 << 3) | (1 << 5)).into();
    let mut out = Vec::new();
    b.finalize().to_aml_bytes(&mut out);
    out
}

fn madt(vcpus: u8) -> Vec<u8> {
    let mut m = madt::MADT::new(
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
        madt::LocalInterruptController::Address(LAPIC_ADDR as u32),
    );
    for id in 0..vcpus {
        m.add_structure(madt::ProcessorLocalApic::new(
            id,
            id,
            madt::EnabledStatus::Enabled,
        ));
    }
    m.add_structure(madt::IoApic::new(0, IOAPIC_ADDR as u32, 0));
    let mut out = Vec::new();
    m.to_aml_bytes(&mut out);
    out
}

/// Write all tables into guest memory; returns the RSDP address.
pub fn write_tables(mem: &GuestMemoryMmap, cfg: &AcpiConfig) -> Result<u64> {
    if cfg.vcpus == 0 {
        return Err(ConfigError::VcpuCount {
            requested: 0,
            max: crate::vm::MAX_VCPUS,
        }
        .into());
    }
    let mut next = ACPI_START;
    let mut place = |table: &'static str, bytes: &[u8]| -> Result<u64> {
        let addr = next;
        let end = addr + bytes.len() as u64;
        if end > ACPI_TABLES_END {
            return Err(BootError::AcpiTooBig {
                table,
                end,
                limit: ACPI_TABLES_END,
            }
            .into());
        }
        mem.write_slice(bytes, GuestAddress(addr))
            .map_err(|source| BootError::AcpiWrite {
                table,
                addr,
                source,
            })?;
        next = (end + 15) & !15;
        Ok(addr)
    };

    // RSDP first, at the start of the BIOS area where Linux also scans for it.
    let rsdp_addr = place("RSDP", &[0u8; 36])?;
    let dsdt_addr = place("DSDT", &dsdt(cfg))?;
    let fadt_addr = place("FADT", &fadt(dsdt_addr))?;
    let madt_addr = place("MADT", &madt(cfg.vcpus))?;
    let mut xsdt = XSDT::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    xsdt.add_entry(fadt_addr);
    xsdt.add_entry(madt_addr);
    let mut xsdt_bytes = Vec::new();
    xsdt.to_aml_bytes(&mut xsdt_bytes);
    let xsdt_addr = place("XSDT", &xsdt_bytes)?;

    let mut rsdp = Vec::new();
    Rsdp::new(OEM_ID, xsdt_addr).to_aml_bytes(&mut rsdp);
    mem.write_slice(&rsdp, GuestAddress(rsdp_addr))
        .map_err(|source| BootError::AcpiWrite {
            table: "RSDP",
            addr: rsdp_addr,
            source,
        })?;
    Ok(rsdp_addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checksum_ok(t: &[u8]) -> bool {
        t.iter().fold(0u8, |a, b| a.wrapping_add(*b)) == 0
    }

    fn read(mem: &GuestMemoryMmap, addr: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        mem.read_slice(&mut v, GuestAddress(addr)).unwrap();
        v
    }

    fn table_at(mem: &GuestMemoryMmap, addr: u64) -> Vec<u8> {
        let hdr = read(mem, addr, 8);
        let len = u32::from_le_bytes(hdr[4..8].try_into().unwrap()) as usize;
        read(mem, addr, len)
    }

    #[test]
    fn tables_link_up_and_checksum() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 2 << 20)]).unwrap();
        let cfg = AcpiConfig {
            vcpus: 3,
            virtio: vec![VirtioMmioSlot {
                base: VIRTIO_MMIO_BASE,
                size: 0x1000,
                irq: 5,
            }],
            vmgenid: true,
        };
        let rsdp_addr = write_tables(&mem, &cfg).unwrap();
        let rsdp = read(&mem, rsdp_addr, 36);
        assert_eq!(&rsdp[..8], b"RSD PTR ");
        assert!(checksum_ok(&rsdp[..20]) && checksum_ok(&rsdp));
        let xsdt_addr = u64::from_le_bytes(rsdp[24..32].try_into().unwrap());
        let xsdt = table_at(&mem, xsdt_addr);
        assert_eq!(&xsdt[..4], b"XSDT");
        assert!(checksum_ok(&xsdt));
        let entries: Vec<u64> = xsdt[36..]
            .chunks(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(entries.len(), 2);

        let fadt = table_at(&mem, entries[0]);
        assert_eq!(&fadt[..4], b"FACP");
        assert!(checksum_ok(&fadt));
        let flags = u32::from_le_bytes(fadt[112..116].try_into().unwrap());
        assert_ne!(flags & (1 << 20), 0, "hardware-reduced");
        let x_dsdt = u64::from_le_bytes(fadt[140..148].try_into().unwrap());
        let dsdt = table_at(&mem, x_dsdt);
        assert_eq!(&dsdt[..4], b"DSDT");
        assert!(checksum_ok(&dsdt));
        let find = |hay: &[u8], needle: &[u8]| hay.windows(needle.len()).any(|w| w == needle);
        assert!(find(&dsdt, b"_S5_"));
        assert!(find(&dsdt, b"LNRO0005"));
        // The generation ID's device with its address, and the event device that notifies it.
        assert!(find(&dsdt, b"VMGENCTR") && find(&dsdt, b"ADDR") && find(&dsdt, b"ACPI0013"));
        assert!(find(&dsdt, b"_EVT") && find(&dsdt, &(VMGENID_ADDR as u32).to_le_bytes()));

        let madt = table_at(&mem, entries[1]);
        assert_eq!(&madt[..4], b"APIC");
        assert!(checksum_ok(&madt));
        // 44-byte header, then 3 local APICs (8 bytes each) and one IOAPIC (12 bytes).
        assert_eq!(madt.len(), 44 + 3 * 8 + 12);
        assert_eq!(madt[44], 0, "local APIC entry");
        assert_eq!(madt[44 + 3 * 8], 1, "IOAPIC entry");
    }
}
