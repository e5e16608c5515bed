//! Guest kernel and initramfs tooling for Tine.
//!
//! - [`kernel`]: fetch Debian kernel packages (downloaded and unpacked, never installed) into a cache.
//! - [`bzimage`]: pull the uncompressed ELF `vmlinux` out of a bzImage.
//! - [`cpio`] and [`initramfs`]: write `newc` archives and minimal busybox initramfs images.
//! - [`build`]: `tine image build`: guest images (kernel + initramfs holding the whole root
//!   filesystem + the agent) from [`recipe`]s, cached by input hash; [`manifest`] reads them back.
//! - [`agent`]: where the prebuilt static agent comes from; [`elf`] checks it (and busybox) can
//!   run in the guest.
//! - [`cli`]: the `tine image ...` subcommands.

pub mod agent;
pub mod apt;
pub mod build;
pub mod bzimage;
pub mod cache;
pub mod cli;
pub mod compress;
pub mod cpio;
pub mod debootstrap;
pub mod elf;
mod fsutil;
pub mod guest;
pub mod guestpath;
pub mod initramfs;
pub mod kernel;
mod lz4_legacy;
pub mod manifest;
pub mod modules;
mod progress;
pub mod recipe;
pub mod rootfs;
pub mod tarball;
pub mod tree;

pub use build::{build_image, BuildOptions, BuiltImage};
pub use bzimage::{extract_vmlinux, vmlinux_from_bzimage, BzImageError};
pub use cache::default_cache_dir;
pub use compress::Compression;
pub use initramfs::{smoke_init_script, smoke_initramfs, Initramfs, BOOT_MARKER};
pub use kernel::{fetch_kernel, Flavor, Kernel};
pub use manifest::{
    list_images, load_image, load_image_in, load_stored_image, ImageManifest, ImageRef,
};
pub use recipe::Recipe;
