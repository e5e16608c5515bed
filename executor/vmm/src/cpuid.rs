//! CPUID for a vCPU: what KVM supports on this host, adjusted so the guest sees a consistent
//! topology (its own APIC id, the right CPU count) and knows it runs under a hypervisor.

use kvm_bindings::{CpuId, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::Kvm;

use crate::error::{Error, Result};

const LEAF_FEATURES: u32 = 0x1;
const LEAF_CACHE_PARAMS: u32 = 0x4;
const LEAF_PMU: u32 = 0xa;
const LEAF_TOPOLOGY: u32 = 0xb;
const LEAF_TOPOLOGY_V2: u32 = 0x1f;
const LEAF_AMD_SIZES: u32 = 0x8000_0008;
const LEAF_AMD_TOPOLOGY: u32 = 0x8000_001e;

const ECX_HYPERVISOR: u32 = 1 << 31;
const ECX_TSC_DEADLINE: u32 = 1 << 24;
const EDX_HTT: u32 = 1 << 28;

/// The host's supported CPUID, fetched once per VM and specialised per vCPU.
pub fn supported(kvm: &Kvm) -> Result<CpuId> {
    kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(Error::kvm("KVM_GET_SUPPORTED_CPUID"))
}

/// Bits needed to number `n` items (at least 0).
fn width(n: u32) -> u32 {
    if n <= 1 {
        0
    } else {
        32 - (n - 1).leading_zeros()
    }
}

/// Specialise `base` for vCPU `index` of `count`: one socket, one thread per core,
/// `count` cores, APIC id = index.
pub fn for_vcpu(base: &CpuId, index: u32, count: u32, tsc_deadline: bool) -> CpuId {
    let mut cpuid = base.clone();
    let core_bits = width(count);
    for e in cpuid.as_mut_slice() {
        match e.function {
            LEAF_FEATURES => {
                e.ebx = (e.ebx & 0x0000_ffff) | (index << 24) | (count.min(255) << 16);
                e.ecx |= ECX_HYPERVISOR;
                if tsc_deadline {
                    e.ecx |= ECX_TSC_DEADLINE;
                }
                if count > 1 {
                    e.edx |= EDX_HTT;
                } else {
                    e.edx &= !EDX_HTT;
                }
            }
            LEAF_CACHE_PARAMS => {
                // Bits 31:26 = cores per package - 1; bits 25:14 = threads sharing this cache - 1 (0).
                e.eax = (e.eax & 0x3fff) | ((count - 1).min(63) << 26);
            }
            LEAF_PMU => {
                // No virtual PMU: keeps the guest from probing performance-counter MSRs.
                e.eax = 0;
                e.ebx = 0;
                e.ecx = 0;
                e.edx = 0;
            }
            LEAF_TOPOLOGY | LEAF_TOPOLOGY_V2 => {
                e.edx = index;
                match e.index {
                    0 => {
                        // SMT level: one thread per core.
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = 1 << 8;
                    }
                    1 => {
                        // Core level.
                        e.eax = core_bits;
                        e.ebx = count;
                        e.ecx = (2 << 8) | 1;
                    }
                    n => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = n & 0xff;
                    }
                }
            }
            LEAF_AMD_SIZES => {
                // ApicIdSize and NC (cores - 1).
                e.ecx = (core_bits << 12) | (count - 1).min(255);
            }
            LEAF_AMD_TOPOLOGY => {
                e.eax = index;
                e.ebx = index & 0xff; // compute unit id; one thread per unit
                e.ecx = 0;
            }
            _ => {}
        }
    }
    cpuid
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ..Default::default()
        }
    }

    #[test]
    fn topology_is_consistent() {
        let base = CpuId::from_entries(&[entry(1, 0), entry(0xb, 0), entry(0xb, 1)]).unwrap();
        let c = for_vcpu(&base, 2, 4, true);
        let e = c.as_slice();
        assert_eq!(e[0].ebx >> 24, 2, "APIC id");
        assert_eq!((e[0].ebx >> 16) & 0xff, 4, "logical count");
        assert_ne!(e[0].ecx & ECX_HYPERVISOR, 0);
        assert_ne!(e[0].ecx & ECX_TSC_DEADLINE, 0);
        assert_ne!(e[0].edx & EDX_HTT, 0);
        assert_eq!(e[1].edx, 2, "x2APIC id");
        assert_eq!(e[2].ebx, 4);
        assert_eq!(e[2].eax, 2, "bits for 4 cores");
    }

    #[test]
    fn width_counts_bits() {
        assert_eq!(width(1), 0);
        assert_eq!(width(2), 1);
        assert_eq!(width(3), 2);
        assert_eq!(width(4), 2);
        assert_eq!(width(5), 3);
    }
}
