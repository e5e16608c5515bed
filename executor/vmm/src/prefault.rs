//! Mapping a restored child's expected working set before its vCPUs run.
//!
//! Each page a restored guest touches first costs a stage-2 page fault: an exit to the host
//! kernel, a lookup of the page behind the private mapping, and a return to the guest. A
//! child on its way to ready touches the same few hundred pages its snapshot's first child
//! touched (the working set the host records), so those are mapped in one go instead:
//! - `KVM_PRE_FAULT_MEMORY` (Linux 6.10+, with two-dimensional paging) builds KVM's stage-2
//!   entries for them from the host without entering the guest at all. It maps for reading,
//!   as a guest read fault would: a page stays shared with the snapshot until written.
//! - Elsewhere `MADV_POPULATE_READ` (Linux 5.14+) only maps them into the VMM's own page
//!   tables, so the guest's faults still exit but find the page at once.
//!
//! Pages the recorded child also wrote are copied first (`MADV_POPULATE_WRITE`): every child
//! writes them on its way to ready and would take a copy-on-write fault for each. KVM then
//! maps them writable, as the host's mapping allows, so those writes do not exit either. A
//! child holds these copies as it would have after writing them; one that would not have
//! written one holds it all the same (the memory report shows what that costs).
//!
//! A hint, never a requirement: whatever fails is logged and the guest faults as before.

use std::time::{Duration, Instant};

use kvm_bindings::{kvm_pre_fault_memory, KVM_CAP_PRE_FAULT_MEMORY};
use vmm_sys_util::ioctl::ioctl_with_mut_ref;
use vmm_sys_util::ioctl_iowr_nr;

use crate::memory::{GuestRam, RamRange};

const PAGE: u64 = 4096;

ioctl_iowr_nr!(
    KVM_PRE_FAULT_MEMORY,
    kvm_bindings::KVMIO,
    0xd5,
    kvm_pre_fault_memory
);

/// How the pages were mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// KVM's stage-2 tables (`KVM_PRE_FAULT_MEMORY`).
    Kvm,
    /// The VMM's own page tables only (`MADV_POPULATE_READ`).
    Host,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Kvm => "kvm",
            Method::Host => "host",
        }
    }
}

/// What [`crate::Vm::prefault`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Prefaulted {
    /// None: nothing was mapped (no pages, or every method failed).
    pub method: Option<Method>,
    /// Pages asked for that lie inside guest RAM.
    pub pages: u64,
    /// Of those, the ones copied ahead because the child is expected to write them.
    pub copied: u64,
    /// Contiguous runs they made (one request each).
    pub runs: usize,
    pub took: Duration,
    /// Of `took`, copying the pages to be written.
    pub copy_took: Duration,
    /// Why a method gave up, if one did.
    pub error: Option<String>,
}

/// A run of guest pages: its guest-physical address and host address, and its length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    gpa: u64,
    host: u64,
    len: u64,
}

/// Image page numbers as contiguous runs in guest-physical and host addresses: sorted,
/// repeats dropped, pages outside RAM ignored, and runs cut where RAM ranges end (around the
/// MMIO gap the image is contiguous but guest-physical addresses are not).
fn runs(pages: &[u64], ranges: &[(RamRange, u64)]) -> Vec<Run> {
    let mut sorted = pages.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out: Vec<Run> = Vec::new();
    for p in sorted {
        let Some(offset) = p.checked_mul(PAGE) else {
            continue;
        };
        let Some((r, host)) = ranges
            .iter()
            .find(|(r, _)| offset >= r.file_offset && offset - r.file_offset < r.size)
        else {
            continue;
        };
        let gpa = r.guest_addr + (offset - r.file_offset);
        let host = host + (offset - r.file_offset);
        match out.last_mut() {
            Some(last) if last.gpa + last.len == gpa && last.host + last.len == host => {
                last.len += PAGE
            }
            _ => out.push(Run {
                gpa,
                host,
                len: PAGE,
            }),
        }
    }
    out
}

/// Map `touched` and `written` (page numbers of the memory image) for a guest about to run
/// on `vcpu`, copying `written` first.
pub(crate) fn prefault(
    vm: &kvm_ioctls::VmFd,
    vcpu: &kvm_ioctls::VcpuFd,
    ram: &GuestRam,
    touched: &[u64],
    written: &[u64],
) -> Prefaulted {
    let t0 = Instant::now();
    let ranges = match ram.host_ranges() {
        Ok(r) => r,
        Err(e) => {
            return Prefaulted {
                error: Some(e.to_string()),
                ..Prefaulted::default()
            }
        }
    };
    let all: Vec<u64> = touched.iter().chain(written).copied().collect();
    let runs = runs(&all, &ranges);
    let to_copy = self::runs(written, &ranges);
    let mut done = Prefaulted {
        pages: runs.iter().map(|r| r.len / PAGE).sum(),
        runs: runs.len(),
        ..Prefaulted::default()
    };
    if runs.is_empty() {
        return done;
    }
    let mut errors = Vec::new();
    match to_copy
        .iter()
        .try_for_each(|r| populate(r.host, r.len, true))
    {
        Ok(()) => done.copied = to_copy.iter().map(|r| r.len / PAGE).sum(),
        Err(e) => errors.push(format!("MADV_POPULATE_WRITE: {e}")),
    }
    done.copy_took = t0.elapsed();
    if vm.check_extension_raw(KVM_CAP_PRE_FAULT_MEMORY.into()) > 0 {
        match runs
            .iter()
            .try_for_each(|r| kvm_prefault(vcpu, r.gpa, r.len))
        {
            Ok(()) => done.method = Some(Method::Kvm),
            Err(e) => errors.push(format!("KVM_PRE_FAULT_MEMORY: {e}")),
        }
    }
    if done.method.is_none() {
        match runs.iter().try_for_each(|r| populate(r.host, r.len, false)) {
            Ok(()) => done.method = Some(Method::Host),
            Err(e) => errors.push(format!("MADV_POPULATE_READ: {e}")),
        }
    }
    done.error = (!errors.is_empty()).then(|| errors.join("; "));
    done.took = t0.elapsed();
    done
}

/// Calls in a row that may end without progress before a run is given up (a kernel that
/// keeps answering "again" must not hold the spawn forever).
const STALLED_TRIES: u32 = 64;

/// One run through `KVM_PRE_FAULT_MEMORY`, which may stop early (a signal, a reschedule) and
/// say where: go on from there.
fn kvm_prefault(vcpu: &kvm_ioctls::VcpuFd, gpa: u64, len: u64) -> std::io::Result<()> {
    let mut range = kvm_pre_fault_memory {
        gpa,
        size: len,
        ..Default::default()
    };
    let mut stalled = 0;
    while range.size > 0 {
        let before = range.size;
        // SAFETY: the ioctl reads and updates exactly this struct, which outlives the call.
        let rc = unsafe { ioctl_with_mut_ref(vcpu, KVM_PRE_FAULT_MEMORY(), &mut range) };
        if rc < 0 {
            let e = std::io::Error::last_os_error();
            if !matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN)) {
                return Err(e);
            }
        }
        stalled = if range.size < before { 0 } else { stalled + 1 };
        if stalled >= STALLED_TRIES {
            return Err(std::io::Error::other(format!(
                "no progress at guest address {:#x}",
                range.gpa
            )));
        }
    }
    Ok(())
}

/// Fault `[host, host + len)` of guest RAM into the VMM's page tables, for reading or (a
/// private copy of each page) for writing.
fn populate(host: u64, len: u64, write: bool) -> std::io::Result<()> {
    let advice = if write {
        libc::MADV_POPULATE_WRITE
    } else {
        libc::MADV_POPULATE_READ
    };
    for _ in 0..STALLED_TRIES {
        // SAFETY: advice on guest RAM this VM maps; populating never changes its contents.
        let rc = unsafe { libc::madvise(host as *mut libc::c_void, len as usize, advice) };
        if rc == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINTR) {
            return Err(e);
        }
    }
    Err(std::io::Error::other("interrupted every time"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(guest_addr: u64, size: u64, file_offset: u64) -> RamRange {
        RamRange {
            guest_addr,
            size,
            file_offset,
        }
    }

    #[test]
    fn pages_become_sorted_runs_cut_at_the_mmio_gap() {
        let gap = crate::layout::MMIO_GAP_START;
        let ranges = [
            (range(0, gap, 0), 0x7000_0000_0000),
            (
                range(crate::layout::MMIO_GAP_END, 1 << 30, gap),
                0x7100_0000_0000,
            ),
        ];
        let last_low = gap / PAGE - 1;
        let too_far = (gap + (1 << 30)) / PAGE;
        let r = runs(&[5, 3, 4, 4, 9, last_low, last_low + 1, too_far], &ranges);
        assert_eq!(
            r,
            [
                Run {
                    gpa: 3 * PAGE,
                    host: 0x7000_0000_0000 + 3 * PAGE,
                    len: 3 * PAGE
                },
                Run {
                    gpa: 9 * PAGE,
                    host: 0x7000_0000_0000 + 9 * PAGE,
                    len: PAGE
                },
                Run {
                    gpa: gap - PAGE,
                    host: 0x7000_0000_0000 + gap - PAGE,
                    len: PAGE
                },
                Run {
                    gpa: crate::layout::MMIO_GAP_END,
                    host: 0x7100_0000_0000,
                    len: PAGE
                },
            ]
        );
        assert!(runs(&[u64::MAX], &ranges).is_empty());
    }
}
