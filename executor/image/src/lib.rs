//! Guest kernel and initramfs tooling for Tine.
//!
//! - [`kernel`]: fetch Debian kernel packages (downloaded and unpacked, never installed) into a cache.
//! - [`bzimage`]: pull the uncompressed ELF `vmlinux` out of a bzImage.
//! - [`cpio`] and [`initramfs`]: write `newc` archives and minimal busybox initramfs images.
//! - [`cli`]: the `tine image ...` subcommands.

pub mod apt;
pub mod bzimage;
pub mod cache;
pub mod cli;
pub mod cpio;
mod fsutil;
pub mod initramfs;
pub mod kernel;
mod lz4_legacy;
pub mod modules;

pub use bzimage::{extract_vmlinux, vmlinux_from_bzimage, BzImageError};
pub use cache::default_cache_dir;
pub use initramfs::{smoke_init_script, Initramfs, BOOT_MARKER};
pub use kernel::{fetch_kernel, Flavor, Kernel};
