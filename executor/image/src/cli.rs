//! `tine image ...`: fetch kernels, extract vmlinux, build initramfs and guest images.

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::build::export_image;
use crate::initramfs::{
    find_busybox, smoke_init_script, Initramfs, KernelModules, SMOKE_INITRAMFS,
};
use crate::modules::ModuleIndex;
use crate::{
    build_image, default_cache_dir, fetch_kernel, list_images, BuildOptions, Flavor, Recipe,
};

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
    /// Build a guest image (vmlinux + initramfs with the whole root filesystem and the agent)
    /// from a recipe, or reuse the cached one built from the same inputs.
    Build {
        /// Recipe file, or a built-in recipe name (busybox, python-numpy).
        #[arg(default_value = "busybox")]
        recipe: String,
        /// Root filesystem from a directory or a tarball (.tar, .tar.gz, .tar.zst, .tar.xz),
        /// replacing the recipe's.
        #[arg(long, value_name = "DIR|TARBALL")]
        rootfs: Option<PathBuf>,
        /// Name to find the image by (default: the recipe's name).
        #[arg(long)]
        name: Option<String>,
        /// Also copy the image (vmlinux, initrd, image.json) into this directory.
        #[arg(short, long, value_name = "DIR")]
        output: Option<PathBuf>,
        /// Cache directory (default: $TINE_CACHE_DIR or ~/.cache/tine).
        #[arg(long)]
        cache: Option<PathBuf>,
        /// Static tine-agent binary (default: tine-agent beside this tine executable, as
        /// deploy/build.sh places it).
        #[arg(long, env = "TINE_AGENT_BIN", value_name = "PATH")]
        agent: Option<PathBuf>,
        /// Static busybox (default: /bin/busybox from busybox-static).
        #[arg(long, value_name = "PATH")]
        busybox: Option<PathBuf>,
        /// Initramfs compression (default: the recipe's, else zstd).
        #[arg(long, value_enum)]
        compression: Option<crate::Compression>,
        /// Rebuild even if an image with the same inputs is cached.
        #[arg(long)]
        rebuild: bool,
        /// Guest kernel flavour: cloud (small, the default) or generic (Debian's full kernel,
        /// e.g. for its CONFIG_VMGENID driver, which the cloud kernel lacks).
        #[arg(long, value_enum, default_value_t = Flavor::Cloud)]
        kernel: Flavor,
    },
    /// List the images in the cache.
    List {
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
            let output = output.unwrap_or_else(|| cache.join(SMOKE_INITRAMFS));
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
        ImageCommand::Build {
            recipe,
            rootfs,
            name,
            output,
            cache,
            agent,
            busybox,
            compression,
            rebuild,
            kernel,
        } => {
            // The running binary is looked up here, at the edge; the builder gets a path.
            let agent = crate::agent::choose(agent, std::env::current_exe())?;
            let mut opts = BuildOptions::new(
                Recipe::resolve(&recipe)?,
                cache.unwrap_or_else(default_cache_dir),
                agent,
            );
            opts.rootfs = rootfs;
            opts.name = name;
            opts.busybox = busybox;
            opts.compression = compression;
            opts.rebuild = rebuild;
            opts.kernel = kernel;
            let built = build_image(&opts)?;
            let m = &built.manifest;
            eprintln!(
                "tine-image: {} image {} ({}): initrd {:.1} MiB ({}), {:.1} MiB unpacked{}",
                if built.reused { "reusing" } else { "built" },
                m.id,
                m.recipe,
                m.initrd.bytes as f64 / MIB,
                m.compression.name(),
                m.rootfs.unpacked_bytes as f64 / MIB,
                if built.reused {
                    String::new()
                } else {
                    format!(", in {:.1} s", m.build_seconds)
                }
            );
            let dir = match output {
                Some(out) => {
                    export_image(m, &out)?;
                    out
                }
                None => m.dir.clone(),
            };
            println!("image: {}", dir.display());
            print!("{}", m.to_json());
        }
        ImageCommand::List { cache } => {
            let cache = cache.unwrap_or_else(default_cache_dir);
            let images = list_images(&cache)?;
            if images.is_empty() {
                println!(
                    "no images in {}",
                    crate::manifest::images_dir(&cache).display()
                );
            }
            for (m, names) in images {
                println!(
                    "{}  {:<14} initrd {:>7.1} MiB  unpacked {:>7.1} MiB  mem {:>5} MiB  {}  {}",
                    m.id,
                    names.join(","),
                    m.initrd.bytes as f64 / MIB,
                    m.rootfs.unpacked_bytes as f64 / MIB,
                    m.memory_mib,
                    m.kernel_release,
                    m.recipe
                );
            }
        }
    }
    Ok(())
}

const MIB: f64 = 1024.0 * 1024.0;
