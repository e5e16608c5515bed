//! Initial vCPU state for the two entry protocols: segments, control registers, identity page
//! tables, FPU, boot MSRs and the local APIC's LINT pins.

use kvm_bindings::{kvm_fpu, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::boot::EntryPoint;
use crate::error::{BootError, Result, VcpuError};
use crate::layout::*;

const CR0_PE: u64 = 1 << 0;
const CR0_ET: u64 = 1 << 4;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

const SEL_CODE: u16 = 0x08;
const SEL_DATA: u16 = 0x10;
const SEL_TSS: u16 = 0x18;

/// A flat segment described once and rendered both as a GDT descriptor and as KVM state.
#[derive(Clone, Copy)]
struct Segment {
    selector: u16,
    type_: u8,
    /// Code/data (1) vs system (0).
    s: u8,
    /// 32-bit default operand size.
    db: u8,
    /// 64-bit code.
    l: u8,
}

impl Segment {
    const LIMIT: u32 = 0xfffff; // with 4 KiB granularity: 4 GiB

    fn descriptor(&self) -> u64 {
        let flags: u64 = (self.type_ as u64)
            | ((self.s as u64) << 4)
            | (1 << 7) // present
            | ((self.l as u64) << 13)
            | ((self.db as u64) << 14)
            | (1 << 15); // 4 KiB granularity
        ((Self::LIMIT as u64) & 0xffff) | (((Self::LIMIT as u64) >> 16) << 48) | (flags << 40)
    }

    fn kvm(&self) -> kvm_segment {
        kvm_segment {
            base: 0,
            limit: 0xffff_ffff,
            selector: self.selector,
            type_: self.type_,
            present: 1,
            dpl: 0,
            db: self.db,
            s: self.s,
            l: self.l,
            g: 1,
            avl: 0,
            unusable: 0,
            padding: 0,
        }
    }
}

fn segments(entry: EntryPoint) -> (Segment, Segment, Segment) {
    let long = matches!(entry, EntryPoint::Linux64 { .. });
    let code = Segment {
        selector: SEL_CODE,
        type_: 0xb, // execute/read, accessed
        s: 1,
        db: (!long) as u8,
        l: long as u8,
    };
    let data = Segment {
        selector: SEL_DATA,
        type_: 0x3, // read/write, accessed
        s: 1,
        db: 1,
        l: 0,
    };
    let tss = Segment {
        selector: SEL_TSS,
        type_: 0xb, // busy TSS
        s: 0,
        db: 0,
        l: 0,
    };
    (code, data, tss)
}

/// Write the GDT, an empty IDT and (for 64-bit entry) identity page tables covering 4 GiB.
pub fn write_boot_tables(mem: &GuestMemoryMmap, entry: EntryPoint) -> Result<()> {
    let w = |addr: u64, v: u64| {
        mem.write_obj(v, GuestAddress(addr))
            .map_err(|source| BootError::BootTables { source })
    };
    let (code, data, tss) = segments(entry);
    w(BOOT_GDT, 0)?;
    w(BOOT_GDT + 8, code.descriptor())?;
    w(BOOT_GDT + 16, data.descriptor())?;
    w(BOOT_GDT + 24, tss.descriptor())?;
    w(BOOT_IDT, 0)?;
    if let EntryPoint::Linux64 { .. } = entry {
        w(PML4, PDPT | 0x3)?;
        for i in 0..PD_COUNT {
            w(PDPT + i * 8, (PD + i * 0x1000) | 0x3)?;
        }
        for i in 0..(512 * PD_COUNT) {
            // Present, writable, 2 MiB page.
            w(PD + i * 8, (i << 21) | 0x83)?;
        }
    }
    Ok(())
}

/// Registers of the boot vCPU at the kernel entry.
pub fn setup_boot_vcpu(vcpu: &VcpuFd, index: usize, entry: EntryPoint) -> Result<()> {
    let mut sregs: kvm_sregs = vcpu
        .get_sregs()
        .map_err(VcpuError::ioctl(index, "KVM_GET_SREGS"))?;
    let (code, data, tss) = segments(entry);
    sregs.cs = code.kvm();
    let d = data.kvm();
    sregs.ds = d;
    sregs.es = d;
    sregs.fs = d;
    sregs.gs = d;
    sregs.ss = d;
    sregs.tr = tss.kvm();
    sregs.gdt.base = BOOT_GDT;
    sregs.gdt.limit = 4 * 8 - 1;
    sregs.idt.base = BOOT_IDT;
    sregs.idt.limit = 7;

    let mut regs = kvm_regs {
        rflags: 0x2,
        ..Default::default()
    };
    match entry {
        EntryPoint::Linux64 { rip } => {
            sregs.cr0 = CR0_PE | CR0_ET | CR0_PG;
            sregs.cr3 = PML4;
            sregs.cr4 = CR4_PAE;
            sregs.efer = EFER_LME | EFER_LMA;
            regs.rip = rip;
            regs.rsp = BOOT_STACK;
            regs.rbp = BOOT_STACK;
            regs.rsi = ZERO_PAGE;
        }
        EntryPoint::Pvh { rip } => {
            sregs.cr0 = CR0_PE | CR0_ET;
            sregs.cr3 = 0;
            sregs.cr4 = 0;
            sregs.efer = 0;
            regs.rip = rip;
            regs.rbx = PVH_START_INFO;
        }
    }
    vcpu.set_sregs(&sregs)
        .map_err(VcpuError::ioctl(index, "KVM_SET_SREGS"))?;
    vcpu.set_regs(&regs)
        .map_err(VcpuError::ioctl(index, "KVM_SET_REGS"))?;
    Ok(())
}

/// FPU, MSRs and LAPIC, for every vCPU.
pub fn setup_common(vcpu: &VcpuFd, index: usize) -> Result<()> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu)
        .map_err(VcpuError::ioctl(index, "KVM_SET_FPU"))?;

    let entries = boot_msrs();
    let msrs = Msrs::from_entries(&entries).map_err(|source| VcpuError::List {
        index,
        what: "MSR list",
        source,
    })?;
    let n = vcpu
        .set_msrs(&msrs)
        .map_err(VcpuError::ioctl(index, "KVM_SET_MSRS"))?;
    if n != entries.len() {
        return Err(VcpuError::MsrsRefused {
            index,
            which: "boot",
            set: n,
            total: entries.len(),
            refused: entries[n].index,
        }
        .into());
    }

    // LINT0 = ExtINT (legacy PIC), LINT1 = NMI, as firmware would leave them.
    let mut lapic = vcpu
        .get_lapic()
        .map_err(VcpuError::ioctl(index, "KVM_GET_LAPIC"))?;
    for (reg, mode) in [(APIC_LVT0, APIC_MODE_EXTINT), (APIC_LVT1, APIC_MODE_NMI)] {
        let v = lvt_delivery(get_lapic_reg(&lapic.regs, reg), mode);
        set_lapic_reg(&mut lapic.regs, reg, v);
    }
    vcpu.set_lapic(&lapic)
        .map_err(VcpuError::ioctl(index, "KVM_SET_LAPIC"))?;
    Ok(())
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn get_lapic_reg(regs: &[std::os::raw::c_char; 1024], off: usize) -> u32 {
    let b: [u8; 4] = std::array::from_fn(|i| regs[off + i] as u8);
    u32::from_le_bytes(b)
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char; 1024], off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        regs[off + i] = *b as std::os::raw::c_char;
    }
}

fn lvt_delivery(reg: u32, mode: u32) -> u32 {
    (reg & !0x700) | (mode << 8)
}

pub mod msr_index {
    pub const IA32_TSC: u32 = 0x10;
    pub const IA32_SYSENTER_CS: u32 = 0x174;
    pub const IA32_SYSENTER_ESP: u32 = 0x175;
    pub const IA32_SYSENTER_EIP: u32 = 0x176;
    pub const IA32_MISC_ENABLE: u32 = 0x1a0;
    pub const MTRR_DEF_TYPE: u32 = 0x2ff;
    pub const STAR: u32 = 0xc000_0081;
    pub const LSTAR: u32 = 0xc000_0082;
    pub const CSTAR: u32 = 0xc000_0083;
    pub const SYSCALL_MASK: u32 = 0xc000_0084;
    pub const KERNEL_GS_BASE: u32 = 0xc000_0102;
}

fn boot_msrs() -> Vec<kvm_msr_entry> {
    use msr_index::*;
    let e = |index, data| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        e(IA32_SYSENTER_CS, 0),
        e(IA32_SYSENTER_ESP, 0),
        e(IA32_SYSENTER_EIP, 0),
        e(STAR, 0),
        e(CSTAR, 0),
        e(KERNEL_GS_BASE, 0),
        e(SYSCALL_MASK, 0),
        e(LSTAR, 0),
        e(IA32_TSC, 0),
        // Fast string operations enabled, as firmware leaves it.
        e(IA32_MISC_ENABLE, 1),
        // MTRRs enabled, default memory type write-back.
        e(MTRR_DEF_TYPE, (1 << 11) | 6),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_match_the_usual_flat_values() {
        let (code, data, tss) = segments(EntryPoint::Linux64 { rip: 0 });
        assert_eq!(code.descriptor(), 0x00af_9b00_0000_ffff);
        assert_eq!(data.descriptor(), 0x00cf_9300_0000_ffff);
        assert_eq!(tss.descriptor(), 0x008f_8b00_0000_ffff);
        let (code32, _, _) = segments(EntryPoint::Pvh { rip: 0 });
        assert_eq!(code32.descriptor(), 0x00cf_9b00_0000_ffff);
    }

    #[test]
    fn lvt_mode_bits() {
        assert_eq!(lvt_delivery(0x0001_0000, APIC_MODE_EXTINT), 0x0001_0700);
        assert_eq!(lvt_delivery(0x700, APIC_MODE_NMI), 0x400);
    }
}
