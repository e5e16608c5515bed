//! `tine lab [OPTIONS] -- COMMAND...`: run a command inside the nested KVM lab.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Result;

use crate::{Lab, LabCommand, LabConfig};

#[derive(Debug, clap::Args)]
pub struct LabArgs {
    /// L1 memory in MiB.
    #[arg(long, default_value_t = 4096)]
    pub mem_mib: u32,
    /// L1 vCPUs (QEMU -smp). One emulated CPU is slower but, under heavy nested load,
    /// steadier: L1's kvm_amd on TCG has crashed with two.
    #[arg(long, default_value_t = 2)]
    pub cpus: u32,
    /// Wall-clock timeout in seconds; QEMU is killed when it expires.
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// Host directory to export writable, mounted at the same path inside L1 (repeatable).
    #[arg(long, value_name = "DIR")]
    pub share: Vec<PathBuf>,
    /// Append ARG to L1's kernel command line (repeatable; one word each), e.g. `debugfs=off`
    /// to measure what a host kernel setting changes.
    #[arg(long = "kernel-arg", value_name = "ARG")]
    pub kernel_args: Vec<String>,
    /// Only print the command's output (no boot timing lines).
    #[arg(long, short)]
    pub quiet: bool,
    /// The command to run inside L1 (after `--`), in the current directory.
    #[arg(trailing_var_arg = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// A working directory under a masked path (a checkout in /tmp, as CI may use) would not exist
/// inside L1: export the top directory it lives in below the masked path (e.g. the whole
/// checkout for `/tmp/ci/clients/cli`), so the command finds its files and the workspace's
/// binaries where it left them. Returns the directory to add, if any.
fn masked_cwd(cwd: &Path, shares: &[PathBuf]) -> Option<PathBuf> {
    let root = crate::l1::MASKED
        .iter()
        .map(Path::new)
        .find(|m| cwd.starts_with(m))?;
    let first = cwd.strip_prefix(root).ok()?.components().next()?;
    let top = root.join(first);
    let covered = shares.iter().any(|s| top.starts_with(s));
    (!covered).then_some(top)
}

/// Runs the command in the lab and returns its exit status (use it as the process exit code).
pub fn run(args: LabArgs) -> Result<i32> {
    let mut shares = args.share;
    if let Ok(cwd) = std::env::current_dir() {
        if let Some(dir) = masked_cwd(&cwd, &shares) {
            if !args.quiet {
                eprintln!(
                    "tine-lab: {} is hidden inside L1 (tmpfs); sharing it writable",
                    dir.display()
                );
            }
            shares.push(dir);
        }
    }
    let lab = Lab::prepare(LabConfig {
        mem_mib: args.mem_mib,
        cpus: args.cpus.max(1),
        timeout: Duration::from_secs(args.timeout),
        shares,
        progress: !args.quiet,
        kernel_args: args.kernel_args,
        ..LabConfig::default()
    })?;
    let outcome = lab.run(&LabCommand::new(args.command), &mut std::io::stdout())?;
    Ok(outcome.exit_code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkout_under_tmp_is_shared_unless_already_covered() {
        let cwd = Path::new("/tmp/ci/clients/cli");
        assert_eq!(masked_cwd(cwd, &[]), Some(PathBuf::from("/tmp/ci")));
        assert_eq!(masked_cwd(cwd, &[PathBuf::from("/tmp/ci")]), None);
        assert_eq!(masked_cwd(cwd, &[PathBuf::from("/tmp")]), None);
        assert_eq!(masked_cwd(Path::new("/work/main"), &[]), None);
        assert_eq!(masked_cwd(Path::new("/tmp"), &[]), None);
        assert_eq!(
            masked_cwd(Path::new("/run/user/0/x"), &[]),
            Some(PathBuf::from("/run/user"))
        );
    }
}
