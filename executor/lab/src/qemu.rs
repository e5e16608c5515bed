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
    /// Checked with [`check_kernel_arg`].
    pub kernel_args: &'a [String],
}

/// The command line L1 boots with, before any extra argument.
const KERNEL_CMDLINE: &str = "console=ttyS0 panic=-1 quiet";

/// One word for L1's kernel command line: no whitespace, quotes or control characters, which
/// would change how the kernel splits the line (or what QEMU passes).
pub fn check_kernel_arg(a: &str) -> anyhow::Result<()> {
    anyhow::ensure!(
        !a.is_empty()
            && !a
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || c == '"'),
        "--kernel-arg {a:?}: expected one word for the kernel command line (no spaces, quotes \
         or control characters)"
    );
    Ok(())
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
        &std::iter::once(KERNEL_CMDLINE)
            .chain(c.kernel_args.iter().map(String::as_str))
            .collect::<Vec<_>>()
            .join(" "),
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
            kernel_args: &["debugfs=off".into(), "kvm.nx_huge_pages=never".into()],
        });
        let a: Vec<String> = a.into_iter().map(|s| s.into_string().unwrap()).collect();
        let joined = a.join(" ");
        assert!(joined.starts_with("-accel tcg,thread=multi -cpu EPYC,+svm,+npt -m 4096 -smp 2"));
        let append = a.iter().position(|s| s == "-append").unwrap() + 1;
        assert_eq!(
            a[append],
            "console=ttyS0 panic=-1 quiet debugfs=off kvm.nx_huge_pages=never"
        );
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

    #[test]
    fn a_kernel_arg_is_one_word() {
        check_kernel_arg("debugfs=off").unwrap();
        check_kernel_arg("kvm.nx_huge_pages=never").unwrap();
        for bad in ["", "a b", "a\tb", "x=\"y z\"", "init=/bin/sh\n"] {
            let e = check_kernel_arg(bad).unwrap_err().to_string();
            assert!(e.contains("one word"), "{bad:?}: {e}");
        }
    }
}
