//! Default guest kernel and initramfs: the Debian cloud kernel and the smoke initramfs from the
//! cache, fetched or built on first use so `tine run` works with no arguments. Where the cache
//! is read-only (inside `tine lab`, which prepares both before booting L1) a missing one is a
//! clear error, not an attempt to write.

use std::path::PathBuf;

use anyhow::{Context, Result};
use tine_image::{default_cache_dir, fetch_kernel, smoke_initramfs, Flavor};

/// The cloud kernel's ELF vmlinux (PVH entry), fetching and extracting it if needed.
pub fn kernel() -> Result<PathBuf> {
    let cache = default_cache_dir();
    let k = fetch_kernel(Flavor::Cloud, &cache).context("fetching the default guest kernel")?;
    k.vmlinux()
        .context("extracting vmlinux from the cloud kernel")
}

/// The smoke initramfs (prints the boot marker and powers off), built if missing.
pub fn smoke_initrd() -> Result<PathBuf> {
    smoke_initramfs(&default_cache_dir()).context("the default initramfs (--initrd)")
}
