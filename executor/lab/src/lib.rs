//! The nested KVM lab: boots a Debian generic kernel (L1) in QEMU/TCG on an emulated AMD EPYC
//! with SVM, so `/dev/kvm` inside is the real kvm_amd, and runs one host command there.
//!
//! The host root is mounted read-only over 9p at `/host` and the command runs chrooted into it,
//! in the caller's working directory; `shares` are exported writable at their own paths so the
//! command can leave results behind. The cache is read-only inside too, so [`Lab::prepare`]
//! fills in what `tine run` needs by default first. See `docs/lab.md`.
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

use crate::job::Share;
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
    /// Kernel and image cache (default: `$TINE_CACHE_DIR` or `~/.cache/tine`). L1 sees it
    /// read-only, at the same path (exported when it is under a path L1 hides, like `/tmp`).
    pub cache_dir: PathBuf,
    /// Before booting L1, fetch the default guest kernel (cloud, with its vmlinux) and build the
    /// smoke initramfs into the cache, so `tine run` works inside without `--kernel`/`--initrd`.
    pub guest_defaults: bool,
    /// Print boot timing and status lines to stderr.
    pub progress: bool,
    /// Appended to L1's kernel command line, each one word (e.g. `debugfs=off`, to measure a
    /// host kernel setting).
    pub kernel_args: Vec<String>,
}

impl Default for LabConfig {
    fn default() -> Self {
        LabConfig {
            mem_mib: 4096,
            cpus: 2,
            timeout: Duration::from_secs(900),
            shares: Vec::new(),
            cache_dir: tine_image::default_cache_dir(),
            guest_defaults: true,
            progress: true,
            kernel_args: Vec::new(),
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
    /// What L1 mounts over the host root: `config.shares`, and the cache when it needs one.
    shares: Vec<Share>,
}

impl Lab {
    /// Installs missing packages, fetches the generic kernel and builds (or reuses) the L1
    /// initramfs; with `guest_defaults`, also prepares the default guest kernel and initramfs.
    pub fn prepare(mut config: LabConfig) -> Result<Lab> {
        for a in &config.kernel_args {
            qemu::check_kernel_arg(a)?;
        }
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
        let kernel = tine_image::fetch_kernel(Flavor::Lab, &config.cache_dir)
            .context("fetching the L1 kernel")?;
        // KVM_PRE_FAULT_MEMORY: without it children in the lab take every first touch as an
        // exit, and benchmarks show a slower path than a current host's.
        if tine_image::kernel::release_version(&kernel.release).is_none_or(|v| v < (6, 10)) {
            eprintln!(
                "tine-lab: warning: the L1 kernel is {} (older than 6.10: no \
                 KVM_PRE_FAULT_MEMORY, so children are not prefaulted); apt has no \
                 linux-image-6.12-amd64 here (Debian 12's security suite carries it)",
                kernel.release
            );
        }
        let initramfs = l1::l1_initramfs(&kernel, &config.cache_dir)?;
        if config.guest_defaults {
            // A warning, not an error: the lab runs any command, and most need no guest.
            if let Err(e) = prepare_guest_defaults(&config.cache_dir) {
                eprintln!(
                    "tine-lab: warning: could not prepare the default guest kernel and \
                     initramfs ({e:#}); inside L1, `tine run` will need --kernel and --initrd"
                );
            }
        }
        let cache = config.cache_dir.canonicalize().with_context(|| {
            format!(
                "resolving the cache directory {}",
                config.cache_dir.display()
            )
        })?;
        let shares = mounts(&cache, &config.shares);
        Ok(Lab {
            config,
            kernel,
            initramfs,
            shares,
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

/// What `tine run` uses without `--kernel`/`--initrd`: L1 sees the cache read-only, so these
/// are made on the host first.
fn prepare_guest_defaults(cache: &Path) -> Result<()> {
    let kernel = tine_image::fetch_kernel(Flavor::Cloud, cache)?;
    kernel.vmlinux()?;
    tine_image::smoke_initramfs(cache)?;
    Ok(())
}

/// The shares L1 mounts: the (canonical) cache read-only, first, when /init would hide it
/// under a tmpfs and no share already covers it (e.g. `TINE_CACHE_DIR=/tmp/...`), then
/// `shares` writable. First, so a share inside the cache is mounted on top of it.
fn mounts(cache: &Path, shares: &[PathBuf]) -> Vec<Share> {
    let hidden = l1::MASKED.iter().any(|m| cache.starts_with(m));
    let covered = shares.iter().any(|s| cache.starts_with(s));
    let mut all = Vec::with_capacity(shares.len() + 1);
    if hidden && !covered {
        all.push(Share::read_only(cache));
    }
    all.extend(shares.iter().map(Share::writable));
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_under_tmp_is_exported_read_only_unless_a_share_covers_it() {
        let w = || vec![PathBuf::from("/work/out")];
        assert_eq!(
            mounts(Path::new("/tmp/c"), &w()),
            [Share::read_only("/tmp/c"), Share::writable("/work/out")]
        );
        assert_eq!(
            mounts(Path::new("/root/.cache/tine"), &w()),
            [Share::writable("/work/out")]
        );
        assert_eq!(
            mounts(Path::new("/tmp/ci/cache"), &[PathBuf::from("/tmp/ci")]),
            [Share::writable("/tmp/ci")]
        );
        assert_eq!(
            mounts(Path::new("/run/c"), &[]),
            [Share::read_only("/run/c")]
        );
    }
}
