//! The nested KVM lab: boots a Debian generic kernel (L1) in QEMU/TCG on an emulated AMD EPYC
//! with SVM, so `/dev/kvm` inside is the real kvm_amd, and runs one host command there.
//!
//! The host root is mounted read-only over 9p at `/host` and the command runs chrooted into it,
//! in the caller's working directory; `shares` are exported writable at their own paths so the
//! command can leave results behind. See `docs/lab.md`.
//!
//! ```no_run
//! # fn main() -> anyhow::Result<()> {
//! let lab = tine_lab::Lab::prepare(tine_lab::LabConfig::default())?;
//! let cmd = tine_lab::LabCommand::new(["sh", "-c", "ls -l /dev/kvm"]);
//! let outcome = lab.run(&cmd, &mut std::io::stdout())?;
//! assert_eq!(outcome.exit_code, 0);
//! # Ok(()) }
//! ```

pub mod cli;
mod console;
mod job;
mod l1;
mod qemu;
mod runner;

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use tine_image::{apt, Flavor, Kernel};

pub use job::passthrough_env;
pub use l1::L1_MODULES;
pub use runner::{LabError, LabOutcome};

/// Debian packages the lab needs, each with a file that shows it is installed.
pub const PACKAGES: &[(&str, &str)] = &[
    ("qemu-system-x86", "/usr/bin/qemu-system-x86_64"),
    ("busybox-static", "/bin/busybox"),
    ("cpio", "/bin/cpio"),
    ("kmod", "/sbin/depmod"),
];

#[derive(Debug, Clone)]
pub struct LabConfig {
    /// L1 memory (QEMU `-m`).
    pub mem_mib: u32,
    /// L1 vCPUs (QEMU `-smp`).
    pub cpus: u32,
    /// Wall-clock limit for the whole run; QEMU is killed when it expires.
    pub timeout: Duration,
    /// Host directories exported writable and mounted at the same path inside L1.
    pub shares: Vec<PathBuf>,
    /// Kernel and image cache (default: `$TINE_CACHE_DIR` or `~/.cache/tine`).
    pub cache_dir: PathBuf,
    /// Print boot timing and status lines to stderr.
    pub progress: bool,
}

impl Default for LabConfig {
    fn default() -> Self {
        LabConfig {
            mem_mib: 4096,
            cpus: 2,
            timeout: Duration::from_secs(900),
            shares: Vec::new(),
            cache_dir: tine_image::default_cache_dir(),
            progress: true,
        }
    }
}

/// A command to run inside L1.
#[derive(Debug, Clone)]
pub struct LabCommand {
    pub argv: Vec<String>,
    /// Default: the caller's working directory.
    pub cwd: Option<PathBuf>,
    /// Default: [`passthrough_env`] plus `TERM` (the caller's if stdout is a terminal, else `dumb`).
    pub env: Vec<(String, String)>,
}

impl LabCommand {
    pub fn new<I, S>(argv: I) -> LabCommand
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut env = passthrough_env();
        let term = std::env::var("TERM")
            .ok()
            .filter(|_| std::io::stdout().is_terminal())
            .unwrap_or_else(|| "dumb".into());
        env.push(("TERM".into(), term));
        LabCommand {
            argv: argv.into_iter().map(Into::into).collect(),
            cwd: None,
            env,
        }
    }

    pub fn cwd(mut self, dir: impl Into<PathBuf>) -> LabCommand {
        self.cwd = Some(dir.into());
        self
    }

    /// Sets (or overrides) one environment variable.
    pub fn env(mut self, key: impl Into<String>, value: impl Into<String>) -> LabCommand {
        let key = key.into();
        self.env.retain(|(k, _)| *k != key);
        self.env.push((key, value.into()));
        self
    }
}

/// A prepared lab: L1 kernel fetched, L1 initramfs built; [`Lab::run`] boots it per command.
#[derive(Debug, Clone)]
pub struct Lab {
    config: LabConfig,
    kernel: Kernel,
    initramfs: PathBuf,
}

impl Lab {
    /// Installs missing packages, fetches the generic kernel and builds (or reuses) the L1
    /// initramfs.
    pub fn prepare(mut config: LabConfig) -> Result<Lab> {
        apt::ensure_installed(PACKAGES)?;
        for share in &mut config.shares {
            *share = share
                .canonicalize()
                .with_context(|| format!("--share {}", share.display()))?;
            anyhow::ensure!(
                share.is_dir(),
                "--share {} is not a directory",
                share.display()
            );
        }
        let kernel = tine_image::fetch_kernel(Flavor::Generic, &config.cache_dir)
            .context("fetching the L1 (generic) kernel")?;
        let initramfs = l1::l1_initramfs(&kernel, &config.cache_dir)?;
        Ok(Lab {
            config,
            kernel,
            initramfs,
        })
    }

    pub fn config(&self) -> &LabConfig {
        &self.config
    }

    /// The L1 kernel.
    pub fn kernel(&self) -> &Kernel {
        &self.kernel
    }

    /// The cached L1 initramfs (without the per-run job archive).
    pub fn initramfs(&self) -> &Path {
        &self.initramfs
    }
}
