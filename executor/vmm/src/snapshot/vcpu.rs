//! Saving and restoring one vCPU, in the orders KVM needs (see shared KVM-SNAPSHOT notes):
//! save mp_state first (it makes KVM accept pending APIC events) and vcpu_events last; restore
//! CPUID → MP_STATE → REGS → SREGS → XSAVE → XCRS → DEBUGREGS → LAPIC → MSRs → VCPU_EVENTS.

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, VcpuError};

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

#[derive(Serialize, Deserialize)]
pub struct VcpuState {
    pub cpuid: Vec<kvm_cpuid_entry2>,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    pub xsave: kvm_xsave,
    pub xcrs: kvm_xcrs,
    pub debugregs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub tsc_khz: Option<u32>,
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
}

/// Whether an MSR belongs in a snapshot (the list from the KVM snapshot notes).
fn wanted(msr: u32) -> bool {
    matches!(msr,
        0x10 // TSC
        | 0x1b // APIC_BASE
        | 0x174..=0x176 // SYSENTER_*
        | 0x1a0 // MISC_ENABLE
        | 0x48 // SPEC_CTRL
        | 0x200..=0x2ff // MTRRs
        | 0x6e0 // TSC_DEADLINE
        | 0x800..=0xbff // x2APIC
        | 0xda0 // IA32_XSS
        | 0xc000_0080..=0xc000_0084 // EFER, STAR, LSTAR, CSTAR, SFMASK
        | 0xc000_0100..=0xc000_0103 // FS/GS/KERNEL_GS_BASE, TSC_AUX
        | 0x4b56_4d00..=0x4b56_4dff // KVM paravirtual: kvmclock, async PF, steal time, PV EOI
    )
}

/// Candidate MSRs to save on this host: KVM's index list, filtered. One ioctl, so starting a
/// VM stays cheap; MSRs a vCPU refuses to read are dropped when saving (see [`save`]).
pub fn msr_candidates(kvm: &Kvm) -> Result<Vec<u32>> {
    let all = kvm
        .get_msr_index_list()
        .map_err(Error::kvm("KVM_GET_MSR_INDEX_LIST"))?;
    Ok(all
        .as_slice()
        .iter()
        .copied()
        .filter(|m| wanted(*m))
        .collect())
}

/// Read `list`, dropping (once, with a debug note) any MSR KVM stops at: the index list can
/// name MSRs this vCPU model does not implement. What KVM does return is never skipped.
fn read_msrs(fd: &VcpuFd, index: usize, list: &[u32]) -> Result<Vec<kvm_msr_entry>> {
    let mut list = list.to_vec();
    loop {
        let entries: Vec<kvm_msr_entry> = list
            .iter()
            .map(|&i| kvm_msr_entry {
                index: i,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|source| VcpuError::List {
            index,
            what: "MSR list",
            source,
        })?;
        let n = fd
            .get_msrs(&mut msrs)
            .map_err(VcpuError::ioctl(index, "KVM_GET_MSRS"))?;
        if n == list.len() {
            return Ok(msrs.as_slice().to_vec());
        }
        tracing::debug!(msr = list[n], "MSR not readable on this vCPU; not saved");
        list.remove(n);
    }
}

pub fn save(fd: &VcpuFd, index: usize, msr_list: &[u32]) -> Result<VcpuState> {
    let mp_state = fd
        .get_mp_state()
        .map_err(VcpuError::ioctl(index, "KVM_GET_MP_STATE"))?;
    let regs = fd
        .get_regs()
        .map_err(VcpuError::ioctl(index, "KVM_GET_REGS"))?;
    let sregs = fd
        .get_sregs()
        .map_err(VcpuError::ioctl(index, "KVM_GET_SREGS"))?;
    let xsave = fd
        .get_xsave()
        .map_err(VcpuError::ioctl(index, "KVM_GET_XSAVE"))?;
    let xcrs = fd
        .get_xcrs()
        .map_err(VcpuError::ioctl(index, "KVM_GET_XCRS"))?;
    let debugregs = fd
        .get_debug_regs()
        .map_err(VcpuError::ioctl(index, "KVM_GET_DEBUGREGS"))?;
    let lapic = fd
        .get_lapic()
        .map_err(VcpuError::ioctl(index, "KVM_GET_LAPIC"))?;
    let tsc_khz = fd.get_tsc_khz().ok();
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(VcpuError::ioctl(index, "KVM_GET_CPUID2"))?;
    let cpuid: Vec<kvm_cpuid_entry2> = cpuid
        .as_slice()
        .iter()
        .filter(|e| **e != kvm_cpuid_entry2::default())
        .copied()
        .collect();
    let msrs = read_msrs(fd, index, msr_list)?;
    let vcpu_events = fd
        .get_vcpu_events()
        .map_err(VcpuError::ioctl(index, "KVM_GET_VCPU_EVENTS"))?;
    Ok(VcpuState {
        cpuid,
        mp_state,
        regs,
        sregs,
        xsave,
        xcrs,
        debugregs,
        lapic,
        tsc_khz,
        msrs,
        vcpu_events,
    })
}

fn set_msrs(fd: &VcpuFd, index: usize, entries: &[kvm_msr_entry]) -> Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let msrs = Msrs::from_entries(entries).map_err(|source| VcpuError::List {
        index,
        what: "MSR list",
        source,
    })?;
    let n = fd
        .set_msrs(&msrs)
        .map_err(VcpuError::ioctl(index, "KVM_SET_MSRS"))?;
    if n != entries.len() {
        return Err(VcpuError::MsrsRefused {
            index,
            which: "saved",
            set: n,
            total: entries.len(),
            refused: entries[n].index,
        }
        .into());
    }
    Ok(())
}

pub fn restore(fd: &VcpuFd, index: usize, s: &VcpuState) -> Result<()> {
    let cpuid = CpuId::from_entries(&s.cpuid).map_err(|source| VcpuError::List {
        index,
        what: "CPUID",
        source,
    })?;
    fd.set_cpuid2(&cpuid)
        .map_err(VcpuError::ioctl(index, "KVM_SET_CPUID2"))?;
    if let Some(khz) = s.tsc_khz {
        if fd.get_tsc_khz().ok() != Some(khz) {
            fd.set_tsc_khz(khz)
                .map_err(VcpuError::ioctl(index, "KVM_SET_TSC_KHZ"))?;
        }
    }
    fd.set_mp_state(s.mp_state)
        .map_err(VcpuError::ioctl(index, "KVM_SET_MP_STATE"))?;
    fd.set_regs(&s.regs)
        .map_err(VcpuError::ioctl(index, "KVM_SET_REGS"))?;
    fd.set_sregs(&s.sregs)
        .map_err(VcpuError::ioctl(index, "KVM_SET_SREGS"))?;
    // SAFETY: the buffer is a kvm_xsave of the size KVM_GET_XSAVE produced.
    unsafe { fd.set_xsave(&s.xsave) }.map_err(VcpuError::ioctl(index, "KVM_SET_XSAVE"))?;
    fd.set_xcrs(&s.xcrs)
        .map_err(VcpuError::ioctl(index, "KVM_SET_XCRS"))?;
    fd.set_debug_regs(&s.debugregs)
        .map_err(VcpuError::ioctl(index, "KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&s.lapic)
        .map_err(VcpuError::ioctl(index, "KVM_SET_LAPIC"))?;
    // TSC_DEADLINE only sticks once the LAPIC and TSC are set: a final, separate call. A zero
    // deadline would leave the timer unarmed forever, so arm it "now" instead.
    let (deadline, rest): (Vec<_>, Vec<_>) = s
        .msrs
        .iter()
        .copied()
        .partition(|m| m.index == MSR_IA32_TSC_DEADLINE);
    set_msrs(fd, index, &rest)?;
    let tsc = rest
        .iter()
        .find(|m| m.index == MSR_IA32_TSC)
        .map(|m| m.data);
    let deadline: Vec<kvm_msr_entry> = deadline
        .into_iter()
        .map(|mut m| {
            if m.data == 0 {
                m.data = tsc.unwrap_or(0);
            }
            m
        })
        .collect();
    set_msrs(fd, index, &deadline)?;
    fd.set_vcpu_events(&s.vcpu_events)
        .map_err(VcpuError::ioctl(index, "KVM_SET_VCPU_EVENTS"))?;
    // EINVAL when the guest does not use kvmclock: nothing to tell then.
    let _ = fd.kvmclock_ctrl();
    Ok(())
}
