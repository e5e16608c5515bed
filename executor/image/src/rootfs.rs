//! Where an image's root filesystem comes from: nothing (busybox only), debootstrap, a
//! directory or a tarball. Each source has a key for the image cache and yields a directory
//! tree that [`crate::tree`] turns into the initramfs.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use sha2::{Digest, Sha256};

use crate::debootstrap::{installed_packages, Debootstrap};
use crate::recipe::RootfsSource;

/// A root filesystem ready to be packed.
pub struct PreparedRootfs {
    /// None: the image has no base tree (busybox + agent only).
    pub root: Option<PathBuf>,
    /// Keeps an unpacked tarball alive until the image is written.
    _unpacked: Option<tempfile::TempDir>,
    /// Installed Debian packages, if the tree has a dpkg database.
    pub packages: BTreeMap<String, String>,
}

/// `--rootfs PATH` from the command line: a directory or a tarball.
pub fn source_from_path(path: &Path) -> Result<RootfsSource> {
    let meta = fs::metadata(path).with_context(|| format!("--rootfs {}", path.display()))?;
    let path = path
        .canonicalize()
        .with_context(|| format!("resolving {}", path.display()))?;
    Ok(if meta.is_dir() {
        RootfsSource::Dir { path }
    } else {
        RootfsSource::Tarball { path }
    })
}

/// Describes `source` for the image cache key; cheap (no debootstrap, no unpacking).
pub fn cache_key(source: Option<&RootfsSource>) -> Result<serde_json::Value> {
    Ok(match source {
        None => serde_json::json!({ "kind": "none" }),
        Some(RootfsSource::Debootstrap {
            suite,
            mirror,
            variant,
            packages,
        }) => {
            let d = Debootstrap::new(suite, mirror, variant, packages)?;
            serde_json::json!({ "kind": "debootstrap", "spec": d })
        }
        Some(RootfsSource::Dir { path }) => {
            serde_json::json!({ "kind": "dir", "tree": tree_digest(path)? })
        }
        Some(RootfsSource::Tarball { path }) => {
            serde_json::json!({ "kind": "tarball", "sha256": file_sha256(path)? })
        }
    })
}

/// Produces the tree for `source`; `scratch` receives unpacked tarballs.
pub fn prepare(
    source: Option<&RootfsSource>,
    cache: &Path,
    scratch: &Path,
) -> Result<PreparedRootfs> {
    let (root, unpacked) = match source {
        None => (None, None),
        Some(RootfsSource::Debootstrap {
            suite,
            mirror,
            variant,
            packages,
        }) => {
            let d = Debootstrap::new(suite, mirror, variant, packages)?;
            (Some(d.rootfs(cache)?), None)
        }
        Some(RootfsSource::Dir { path }) => {
            if !path.is_dir() {
                anyhow::bail!("rootfs directory {} does not exist", path.display());
            }
            (Some(path.clone()), None)
        }
        Some(RootfsSource::Tarball { path }) => {
            let tmp = tempfile::Builder::new()
                .prefix(".rootfs-")
                .tempdir_in(scratch)
                .context("creating a directory for the tarball")?;
            let stats = crate::tarball::unpack(path, tmp.path())?;
            eprintln!(
                "tine-image: unpacked {} entries from {}{}",
                stats.entries,
                path.display(),
                if stats.skipped_special > 0 {
                    format!(" (skipped {} device nodes/FIFOs)", stats.skipped_special)
                } else {
                    String::new()
                }
            );
            (Some(tmp.path().to_path_buf()), Some(tmp))
        }
    };
    let packages = root.as_deref().map(installed_packages).unwrap_or_default();
    Ok(PreparedRootfs {
        root,
        _unpacked: unpacked,
        packages,
    })
}

/// A digest of a directory tree's names, types, modes, sizes, mtimes and symlink targets (not
/// file contents: a changed file changes its mtime, and reading a whole rootfs is slow).
pub fn tree_digest(root: &Path) -> Result<String> {
    let mut h = Sha256::new();
    digest_dir(root, root, &mut h)?;
    Ok(hex::encode(h.finalize()))
}

fn digest_dir(root: &Path, dir: &Path, h: &mut Sha256) -> Result<()> {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let m = fs::symlink_metadata(&path)?;
        let rel = path.strip_prefix(root).unwrap_or(&path);
        h.update(rel.as_os_str().as_encoded_bytes());
        h.update(
            format!(
                "\0{:o}\0{}\0{}.{}\0",
                m.mode(),
                m.size(),
                m.mtime(),
                m.mtime_nsec()
            )
            .as_bytes(),
        );
        if m.file_type().is_symlink() {
            h.update(fs::read_link(&path)?.as_os_str().as_encoded_bytes());
        } else if m.is_dir() {
            digest_dir(root, &path, h)?;
        }
    }
    Ok(())
}

pub fn file_sha256(path: &Path) -> Result<String> {
    let mut f = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_digest_changes_with_the_tree() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::create_dir_all(root.join("etc")).unwrap();
        fs::write(root.join("etc/a"), "1").unwrap();
        let d1 = tree_digest(root).unwrap();
        assert_eq!(d1, tree_digest(root).unwrap());
        fs::write(root.join("etc/a"), "22").unwrap();
        let d2 = tree_digest(root).unwrap();
        assert_ne!(d1, d2);
        std::os::unix::fs::symlink("etc/a", root.join("l")).unwrap();
        assert_ne!(d2, tree_digest(root).unwrap());
    }

    #[test]
    fn rootfs_path_is_a_dir_or_a_tarball() {
        let tmp = tempfile::tempdir().unwrap();
        assert!(matches!(
            source_from_path(tmp.path()).unwrap(),
            RootfsSource::Dir { .. }
        ));
        let t = tmp.path().join("r.tar");
        fs::write(&t, b"").unwrap();
        assert!(matches!(
            source_from_path(&t).unwrap(),
            RootfsSource::Tarball { .. }
        ));
        assert!(source_from_path(&tmp.path().join("missing")).is_err());
    }
}
