//! The QEMU command line for L1 (from LAB.md): TCG emulating an EPYC with SVM and NPT, so KVM
//! inside is the real kvm_amd.

use std::ffi::OsString;
use std::path::Path;

use crate::job::{share_tag, Share};
use crate::l1::HOST_TAG;

pub const QEMU: &str = "qemu-system-x86_64";

pub struct QemuConfig<'a> {
    pub kernel: &'a Path,
    pub initrd: &'a Path,
    pub mem_mib: u32,
    pub cpus: u32,
    pub shares: &'a [Share],
}

/// QEMU's option parser splits on `,`; a literal comma is written `,,`.
fn escape(p: &Path) -> String {
    p.to_string_lossy().replace(',', ",,")
}

pub fn args(c: &QemuConfig<'_>) -> Vec<OsString> {
    let mut a: Vec<String> = [
        "-accel",
        "tcg,thread=multi",
        "-cpu",
        "EPYC,+svm,+npt",
        "-m",
        &c.mem_mib.to_string(),
        "-smp",
        &c.cpus.to_string(),
        "-nographic",
        "-no-reboot",
        "-kernel",
        &escape(c.kernel),
        "-initrd",
        &escape(c.initrd),
        "-append",
        "console=ttyS0 panic=-1 quiet",
        "-virtfs",
        &format!(
            "local,path=/,mount_tag={HOST_TAG},security_model=none,readonly=on,multidevs=remap"
        ),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    for (i, share) in c.shares.iter().enumerate() {
        a.push("-virtfs".into());
        a.push(format!(
            "local,path={},mount_tag={},security_model=none,{}multidevs=remap",
            escape(&share.dir),
            share_tag(i),
            if share.writable { "" } else { "readonly=on," }
        ));
    }
    a.into_iter().map(OsString::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_the_lab_md_command_line_with_shares() {
        let shares = [Share::writable("/work/out,1"), Share::read_only("/c")];
        let a = args(&QemuConfig {
            kernel: Path::new("/k/vmlinuz"),
            initrd: Path::new("/t/initrd"),
            mem_mib: 4096,
            cpus: 2,
            shares: &shares,
        });
        let a: Vec<String> = a.into_iter().map(|s| s.into_string().unwrap()).collect();
        let joined = a.join(" ");
        assert!(joined.starts_with("-accel tcg,thread=multi -cpu EPYC,+svm,+npt -m 4096 -smp 2"));
        assert!(joined.contains("-append console=ttyS0 panic=-1 quiet"));
        assert!(a.contains(
            &"local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap".into()
        ));
        assert!(a.contains(
            &"local,path=/work/out,,1,mount_tag=tineshare0,security_model=none,multidevs=remap"
                .into()
        ));
        assert!(a.contains(
            &"local,path=/c,mount_tag=tineshare1,security_model=none,readonly=on,multidevs=remap"
                .into()
        ));
    }
}
