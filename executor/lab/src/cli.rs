//! `tine lab [OPTIONS] -- COMMAND...`: run a command inside the nested KVM lab.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;

use crate::{Lab, LabCommand, LabConfig};

#[derive(Debug, clap::Args)]
pub struct LabArgs {
    /// L1 memory in MiB.
    #[arg(long, default_value_t = 4096)]
    pub mem_mib: u32,
    /// Wall-clock timeout in seconds; QEMU is killed when it expires.
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// Host directory to export writable, mounted at the same path inside L1 (repeatable).
    #[arg(long, value_name = "DIR")]
    pub share: Vec<PathBuf>,
    /// Only print the command's output (no boot timing lines).
    #[arg(long, short)]
    pub quiet: bool,
    /// The command to run inside L1 (after `--`), in the current directory.
    #[arg(trailing_var_arg = true, required = true, value_name = "COMMAND")]
    pub command: Vec<String>,
}

/// Runs the command in the lab and returns its exit status (use it as the process exit code).
pub fn run(args: LabArgs) -> Result<i32> {
    let lab = Lab::prepare(LabConfig {
        mem_mib: args.mem_mib,
        timeout: Duration::from_secs(args.timeout),
        shares: args.share,
        progress: !args.quiet,
        ..LabConfig::default()
    })?;
    let outcome = lab.run(&LabCommand::new(args.command), &mut std::io::stdout())?;
    Ok(outcome.exit_code)
}
