//! Default guest kernel and initramfs: the Debian cloud kernel and the smoke initramfs from the
//! cache, fetched or built on first use so `tine run` works with no arguments.

use std::path::PathBuf;

use anyhow::{Context, Result};
use tine_image::initramfs::find_busybox;
use tine_image::{default_cache_dir, fetch_kernel, smoke_init_script, Flavor, Initramfs};

/// The cloud kernel's ELF vmlinux (PVH entry), fetching and extracting it if needed.
pub fn kernel() -> Result<PathBuf> {
    let cache = default_cache_dir();
    let k = fetch_kernel(Flavor::Cloud, &cache).context("fetching the default guest kernel")?;
    k.vmlinux()
        .context("extracting vmlinux from the cloud kernel")
}

/// The smoke initramfs (prints the boot marker and powers off), built if missing.
pub fn smoke_initrd() -> Result<PathBuf> {
    let path = default_cache_dir().join("smoke-initramfs.cpio.gz");
    if !path.exists() {
        Initramfs::new(smoke_init_script(&[]))
            .busybox(find_busybox()?)
            .write_gz(&path)
            .with_context(|| format!("building {}", path.display()))?;
    }
    Ok(path)
}
