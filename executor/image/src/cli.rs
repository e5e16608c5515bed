//! `tine image ...`: fetch kernels, extract vmlinux, build initramfs images.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::initramfs::{find_busybox, smoke_init_script, Initramfs, KernelModules};
use crate::modules::ModuleIndex;
use crate::{default_cache_dir, fetch_kernel, Flavor};

#[derive(Debug, clap::Subcommand)]
pub enum ImageCommand {
    /// Download and unpack a Debian kernel (never installed) into the cache; print its paths.
    Kernel {
        /// cloud: the guest kernel; generic: the nested lab's L1 kernel.
        #[arg(long, value_enum, default_value_t = Flavor::Cloud)]
        flavor: Flavor,
        /// Cache directory (default: $TINE_CACHE_DIR or ~/.cache/tine).
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Also extract the ELF vmlinux (always done for the cloud flavour).
        #[arg(long)]
        vmlinux: bool,
    },
    /// Extract the ELF vmlinux from a bzImage.
    Vmlinux {
        bzimage: PathBuf,
        /// Output path (default: vmlinux-* next to the bzImage).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Build a gzip-compressed busybox initramfs.
    Initramfs {
        /// Output path (default: <cache>/smoke-initramfs.cpio.gz).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// /init script to use; default: the smoke init that prints "TINE-BOOT-OK cpus=N
        /// kernel=R" and powers off.
        #[arg(long)]
        init_script: Option<PathBuf>,
        /// Kernel module to include (repeatable); dependencies are added and, with the smoke
        /// init, everything is insmod-ed in order.
        #[arg(long = "module", value_name = "NAME")]
        modules: Vec<String>,
        /// Kernel flavour whose modules --module refers to.
        #[arg(long, value_enum, default_value_t = Flavor::Cloud)]
        flavor: Flavor,
        /// Static busybox to use (default: /bin/busybox from busybox-static).
        #[arg(long)]
        busybox: Option<PathBuf>,
        /// Cache directory (default: $TINE_CACHE_DIR or ~/.cache/tine).
        #[arg(long)]
        cache: Option<PathBuf>,
    },
}

pub fn run(cmd: ImageCommand) -> Result<()> {
    match cmd {
        ImageCommand::Kernel {
            flavor,
            cache,
            vmlinux,
        } => {
            let cache = cache.unwrap_or_else(default_cache_dir);
            let k = fetch_kernel(flavor, &cache)?;
            println!("package:  {} {}", k.package, k.version);
            println!("release:  {}", k.release);
            println!("vmlinuz:  {}", k.vmlinuz.display());
            if vmlinux || flavor == Flavor::Cloud {
                println!("vmlinux:  {}", k.vmlinux()?.display());
            }
            println!("modules:  {}", k.modules_dir.display());
        }
        ImageCommand::Vmlinux { bzimage, output } => {
            let out = match output {
                Some(out) => {
                    crate::bzimage::extract_vmlinux_to(&bzimage, &out)?;
                    out
                }
                None => crate::extract_vmlinux(&bzimage)?,
            };
            println!("vmlinux:  {}", out.display());
        }
        ImageCommand::Initramfs {
            output,
            init_script,
            modules,
            flavor,
            busybox,
            cache,
        } => {
            let cache = cache.unwrap_or_else(default_cache_dir);
            let output = output.unwrap_or_else(|| cache.join("smoke-initramfs.cpio.gz"));
            let busybox = match busybox {
                Some(b) => b,
                None => find_busybox()?,
            };
            let mods = if modules.is_empty() {
                None
            } else {
                let kernel = fetch_kernel(flavor, &cache)?;
                let names: Vec<&str> = modules.iter().map(String::as_str).collect();
                Some(KernelModules::with_dependencies(
                    ModuleIndex::load(&kernel.modules_dir)?,
                    &names,
                )?)
            };
            let init = match init_script {
                Some(path) => std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?,
                None => {
                    smoke_init_script(&mods.as_ref().map(|m| m.archive_paths()).unwrap_or_default())
                }
            };
            let mut image = Initramfs::new(init).busybox(busybox);
            if let Some(m) = mods {
                image = image.modules(m);
            }
            image.write_gz(&output)?;
            println!("initramfs: {}", output.display());
        }
    }
    Ok(())
}
