//! KVM's own counters for a VM and its vCPUs, through its binary statistics files (Linux
//! 5.14+): exits by reason, nested page faults, halts, injected interrupts. They count what
//! KVM handles in the kernel too (page faults, halts, MSR accesses), which never reaches the
//! VMM as an exit, so they are how a boot or a restore is profiled by cause.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};

/// `KVM_GET_STATS_FD`, `_IO(KVMIO, 0xce)`, on a VM or vCPU descriptor.
const KVM_GET_STATS_FD: libc::c_ulong = 0xAECE;
/// The fixed part of `struct kvm_stats_desc`; its name (`name_size` bytes) follows.
const DESC_FIXED: usize = 16;
const HEADER_LEN: usize = 24;
/// Far above any kernel's count; a bound so a bad header cannot make us allocate wildly.
const MAX_FIELDS: u32 = 4096;
const MAX_NAME: u32 = 256;

/// `KVM_STATS_TYPE_*` in the low 4 bits of a descriptor's flags.
const TYPE_MASK: u32 = 0xf;
const TYPE_CUMULATIVE: u32 = 0;
const TYPE_INSTANT: u32 = 1;

#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    #[error("KVM_GET_STATS_FD: {0} (KVM statistics need Linux 5.14 or later)")]
    Open(std::io::Error),
    #[error("reading KVM statistics: {0}")]
    Read(std::io::Error),
    #[error("KVM statistics: {0}")]
    Malformed(String),
}

/// One counter of a statistics file: where its value is, and its name.
#[derive(Debug, Clone)]
struct Field {
    name: String,
    /// Byte offset of its u64 in the data block.
    offset: u64,
}

/// One VM's or vCPU's statistics file, its layout read once.
#[derive(Debug)]
pub struct StatsFile {
    file: std::fs::File,
    data_offset: u64,
    fields: Vec<Field>,
}

impl StatsFile {
    /// The statistics of the VM or vCPU behind `fd`. `instant`: also keep values that are
    /// states rather than counts (e.g. a VM's mappings by page size); cumulative counters are
    /// always kept, histograms never.
    pub fn open(fd: &impl AsRawFd, instant: bool) -> Result<StatsFile, StatsError> {
        // SAFETY: an ioctl without arguments that returns a new descriptor.
        let raw = unsafe { libc::ioctl(fd.as_raw_fd(), KVM_GET_STATS_FD, 0) };
        if raw < 0 {
            return Err(StatsError::Open(std::io::Error::last_os_error()));
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        let mut header = [0u8; HEADER_LEN];
        file.read_exact_at(&mut header, 0)
            .map_err(StatsError::Read)?;
        let word = |i: usize| u32::from_le_bytes(header[i * 4..i * 4 + 4].try_into().unwrap());
        let (name_size, count, desc_offset, data_offset) = (word(1), word(2), word(4), word(5));
        if count > MAX_FIELDS || name_size > MAX_NAME {
            return Err(StatsError::Malformed(format!(
                "{count} fields with names of {name_size} bytes"
            )));
        }
        let desc_len = DESC_FIXED + name_size as usize;
        let mut descs = vec![0u8; desc_len * count as usize];
        file.read_exact_at(&mut descs, desc_offset.into())
            .map_err(StatsError::Read)?;
        let fields = descs
            .chunks_exact(desc_len)
            .filter_map(|d| {
                let flags = u32::from_le_bytes(d[0..4].try_into().unwrap());
                let size = u16::from_le_bytes(d[6..8].try_into().unwrap());
                let offset = u32::from_le_bytes(d[8..12].try_into().unwrap());
                let kind = flags & TYPE_MASK;
                let wanted = kind == TYPE_CUMULATIVE || (instant && kind == TYPE_INSTANT);
                // size > 1: an array (a histogram's buckets).
                (wanted && size == 1).then(|| Field {
                    name: name_of(&d[DESC_FIXED..]),
                    offset: offset.into(),
                })
            })
            .collect();
        Ok(StatsFile {
            file,
            data_offset: data_offset.into(),
            fields,
        })
    }

    /// Every kept counter's value now.
    pub fn read(&self) -> Result<Counters, StatsError> {
        let end = self.fields.iter().map(|f| f.offset + 8).max().unwrap_or(0);
        let mut data = vec![0u8; end as usize];
        self.file
            .read_exact_at(&mut data, self.data_offset)
            .map_err(StatsError::Read)?;
        Ok(Counters(
            self.fields
                .iter()
                .map(|f| {
                    let at = f.offset as usize;
                    let v = u64::from_le_bytes(data[at..at + 8].try_into().unwrap());
                    (f.name.clone(), v)
                })
                .collect(),
        ))
    }
}

fn name_of(bytes: &[u8]) -> String {
    let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// Counter name → value. A VM's are its vCPUs' summed, plus its own under `vm.`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Counters(pub BTreeMap<String, u64>);

impl Counters {
    pub fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0)
    }

    /// Add `other`'s values, name by name.
    pub fn add(&mut self, other: &Counters) {
        for (k, v) in &other.0 {
            *self.0.entry(k.clone()).or_default() += v;
        }
    }

    /// Add `other`'s values under `prefix`.
    pub fn add_prefixed(&mut self, prefix: &str, other: &Counters) {
        for (k, v) in &other.0 {
            *self.0.entry(format!("{prefix}{k}")).or_default() += v;
        }
    }
}

/// The statistics files of one VM: its own and each vCPU's.
#[derive(Debug)]
pub struct VmStats {
    vm: StatsFile,
    vcpus: Vec<StatsFile>,
}

impl VmStats {
    /// Open them for `vm` and `vcpus`, or say why not (an older kernel).
    pub fn open(vm: &impl AsRawFd, vcpus: &[impl AsRawFd]) -> Result<VmStats, StatsError> {
        Ok(VmStats {
            vm: StatsFile::open(vm, true)?,
            vcpus: vcpus
                .iter()
                .map(|v| StatsFile::open(v, false))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The vCPUs' counters summed, and the VM's own under `vm.`.
    pub fn read(&self) -> Result<Counters, StatsError> {
        let mut all = Counters::default();
        for v in &self.vcpus {
            all.add(&v.read()?);
        }
        all.add_prefixed("vm.", &self.vm.read()?);
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adding_sums_name_by_name() {
        let a = Counters([("exits".to_string(), 10), ("pf_taken".to_string(), 4)].into());
        let b = Counters([("exits".to_string(), 25), ("halt_exits".to_string(), 2)].into());
        let mut sum = a.clone();
        sum.add(&b);
        assert_eq!(sum.get("exits"), 35);
        assert_eq!(sum.get("pf_taken"), 4);
        assert_eq!(sum.get("halt_exits"), 2);
        sum.add_prefixed("vm.", &a);
        assert_eq!(sum.get("vm.exits"), 10);
        assert_eq!(sum.get("exits"), 35);
    }

    #[test]
    fn names_end_at_their_nul() {
        assert_eq!(name_of(b"exits\0\0\0garbage"), "exits");
        assert_eq!(name_of(b"no_nul"), "no_nul");
    }
}
