//! The host facts a snapshot depends on: restoring vCPU state captured on another CPU model
//! (different CPUID, MSRs, XSAVE layout) or under a different KVM can crash or corrupt the guest.

use serde::{Deserialize, Serialize};

use crate::error::HostMismatch;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIdentity {
    /// CPUID vendor string, e.g. "AuthenticAMD".
    pub cpu_vendor: String,
    /// CPUID leaf 1 EAX: family, model, stepping.
    pub cpu_signature: u32,
    pub cpu_model_name: String,
    /// `uname -r` of the host that took the snapshot.
    pub kernel_release: String,
}

impl HostIdentity {
    /// This host's identity, read once per process: a confined VMM may no longer be able to
    /// read /proc when it writes a snapshot, and the host does not change under it.
    pub fn current() -> Self {
        static HERE: std::sync::OnceLock<HostIdentity> = std::sync::OnceLock::new();
        HERE.get_or_init(Self::read).clone()
    }

    fn read() -> Self {
        let (vendor, signature) = {
            let l0 = std::arch::x86_64::__cpuid(0);
            let mut v = Vec::with_capacity(12);
            for r in [l0.ebx, l0.edx, l0.ecx] {
                v.extend_from_slice(&r.to_le_bytes());
            }
            (
                String::from_utf8_lossy(&v).into_owned(),
                std::arch::x86_64::__cpuid(1).eax,
            )
        };
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let model_name = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        Self {
            cpu_vendor: vendor,
            cpu_signature: signature,
            cpu_model_name: model_name,
            kernel_release: release,
        }
    }

    /// Why a snapshot taken on `self` cannot be restored on `here`, if it cannot.
    pub fn incompatibility(&self, here: &HostIdentity) -> Option<HostMismatch> {
        if self.cpu_vendor != here.cpu_vendor
            || self.cpu_signature != here.cpu_signature
            || self.cpu_model_name != here.cpu_model_name
        {
            return Some(HostMismatch::Cpu {
                snapshot: Box::new(self.clone()),
                here: Box::new(here.clone()),
            });
        }
        if major_minor(&self.kernel_release) != major_minor(&here.kernel_release) {
            return Some(HostMismatch::Kernel {
                snapshot: self.kernel_release.clone(),
                here: here.kernel_release.clone(),
            });
        }
        None
    }
}

fn major_minor(release: &str) -> (u32, u32) {
    let mut it = release
        .split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse().unwrap_or(0));
    (it.next().unwrap_or(0), it.next().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_host_is_compatible_other_cpu_is_not() {
        let here = HostIdentity::current();
        assert!(here.incompatibility(&here).is_none());
        let mut other = here.clone();
        other.cpu_signature ^= 0x10;
        let why = other.incompatibility(&here).unwrap();
        assert!(matches!(why, HostMismatch::Cpu { .. }), "{why:?}");
        assert!(why.to_string().contains("same CPU model"), "{why}");
        let mut patched = here.clone();
        patched.kernel_release = format!("{}.999", here.kernel_release);
        let mut newer = here.clone();
        newer.kernel_release = "99.1.0".into();
        let why = newer.incompatibility(&here).unwrap();
        assert!(
            matches!(&why, HostMismatch::Kernel { snapshot, .. } if snapshot == "99.1.0"),
            "{why:?}"
        );
        assert!(why.to_string().contains("kernel 99.1.0"), "{why}");
        assert!(
            patched.incompatibility(&here).is_none(),
            "patch releases are compatible"
        );
    }
}
