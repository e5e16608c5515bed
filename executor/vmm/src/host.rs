//! Facts about the KVM host: whether /dev/kvm can be opened and what kind of virtualization
//! backs it. A PVM host (kvm_pvm) runs guest ring 3 natively but emulates ring 0, so a stock
//! Linux kernel cannot boot there; we say so plainly instead of failing deep inside a boot.

use std::path::Path;

use kvm_ioctls::Kvm;

use crate::error::{Error, Result};

/// The virtualization flavour behind /dev/kvm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvmFlavor {
    /// Intel VT-x.
    Vmx,
    /// AMD-V.
    Svm,
    /// Pagetable-based virtual machines (kvm_pvm): fine for tiny ring-3 guests, cannot boot Linux.
    Pvm,
    /// /dev/kvm works but the CPU flags name neither VMX nor SVM.
    Unknown,
}

impl KvmFlavor {
    pub fn detect() -> Self {
        Self::detect_from(
            Path::new("/sys/module/kvm_pvm").exists(),
            &std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default(),
        )
    }

    fn detect_from(pvm_loaded: bool, cpuinfo: &str) -> Self {
        if pvm_loaded {
            return KvmFlavor::Pvm;
        }
        let flags = cpuinfo
            .lines()
            .find(|l| l.starts_with("flags"))
            .unwrap_or_default();
        let has = |f: &str| flags.split_whitespace().any(|w| w == f);
        if has("vmx") {
            KvmFlavor::Vmx
        } else if has("svm") {
            KvmFlavor::Svm
        } else {
            KvmFlavor::Unknown
        }
    }

    /// Whether a stock Linux kernel can boot on this flavour.
    pub fn boots_linux(self) -> bool {
        matches!(self, KvmFlavor::Vmx | KvmFlavor::Svm)
    }

    pub fn describe(self) -> &'static str {
        match self {
            KvmFlavor::Vmx => "Intel VT-x",
            KvmFlavor::Svm => "AMD-V (SVM)",
            KvmFlavor::Pvm => "PVM (kvm_pvm): guest ring 0 is emulated; stock Linux kernels cannot boot here — use a host with VMX/SVM or the nested lab (`tine lab -- ...`)",
            KvmFlavor::Unknown => "unknown (no vmx/svm CPU flag)",
        }
    }
}

/// Open /dev/kvm with an error that says what to do.
pub fn open_kvm() -> Result<Kvm> {
    let kvm = Kvm::new().map_err(|e| match e.errno() {
        libc::ENOENT => Error::NoKvm,
        libc::EACCES | libc::EPERM => Error::KvmPermission,
        _ => Error::KvmOpen(std::io::Error::from_raw_os_error(e.errno())),
    })?;
    let version = kvm.get_api_version();
    if version != 12 {
        return Err(Error::KvmApiVersion(version));
    }
    use kvm_ioctls::Cap;
    for (cap, name) in [
        (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
        (Cap::Pit2, "KVM_CAP_PIT2"),
        (Cap::Irqfd, "KVM_CAP_IRQFD"),
        (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
        (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(Error::MissingCap(name));
        }
    }
    Ok(kvm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flavor_from_cpu_flags() {
        let vmx = "processor: 0\nflags\t\t: fpu vme vmx sse\n";
        let svm = "flags\t\t: fpu svm lm\n";
        assert_eq!(KvmFlavor::detect_from(false, vmx), KvmFlavor::Vmx);
        assert_eq!(KvmFlavor::detect_from(false, svm), KvmFlavor::Svm);
        assert_eq!(KvmFlavor::detect_from(true, svm), KvmFlavor::Pvm);
        assert_eq!(
            KvmFlavor::detect_from(false, "flags: fpu hypervisor"),
            KvmFlavor::Unknown
        );
        assert!(!KvmFlavor::Pvm.boots_linux());
        assert!(KvmFlavor::Svm.boots_linux());
    }
}
