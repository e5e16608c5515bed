//! Packs a root filesystem tree plus Tine's own files (the overlay) into one `newc` archive.
//!
//! The base tree is walked in name order (so the same tree gives the same archive), minus the
//! excluded paths; overlay entries replace base entries of the same path and the rest are added
//! at the end. Overlay paths are resolved through the base tree's directory symlinks first, so
//! `/lib/modules/...` lands in `usr/lib/modules/...` on a merged-/usr system rather than
//! turning the `lib` symlink into a directory.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::cpio::CpioWriter;
use crate::guestpath::{self, Excludes};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Dir { mode: u32 },
    File { mode: u32, data: Vec<u8> },
    Symlink { target: String },
    CharDevice { mode: u32, major: u32, minor: u32 },
}

/// Files Tine adds on top of the base tree, keyed by their resolved path (relative, no `/`).
#[derive(Debug, Default)]
pub struct Overlay {
    base: Option<PathBuf>,
    nodes: BTreeMap<String, Node>,
}

impl Overlay {
    pub fn new(base: Option<&Path>) -> Overlay {
        Overlay {
            base: base.map(Path::to_path_buf),
            nodes: BTreeMap::new(),
        }
    }

    /// Adds `node` at the absolute guest path `path`.
    pub fn add(&mut self, path: &str, node: Node) -> Result<()> {
        let rel = self.resolve(path)?;
        if let Some(base) = &self.base {
            let existing = fs::symlink_metadata(base.join(&rel)).ok();
            if existing.is_some_and(|m| m.is_dir()) && !matches!(node, Node::Dir { .. }) {
                bail!("cannot add {path}: the root filesystem has a directory there");
            }
        }
        self.nodes.insert(rel, node);
        Ok(())
    }

    /// True if `path` exists in the base tree or the overlay (without following a final symlink).
    pub fn exists(&self, path: &str) -> bool {
        let Ok(rel) = self.resolve(path) else {
            return false;
        };
        self.nodes.contains_key(&rel)
            || self
                .base
                .as_ref()
                .is_some_and(|b| fs::symlink_metadata(b.join(&rel)).is_ok())
    }

    fn resolve(&self, path: &str) -> Result<String> {
        let parts = guestpath::absolute(path)?;
        Ok(match &self.base {
            Some(base) => guestpath::resolve_parent(base, &parts)?.join("/"),
            None => parts.join("/"),
        })
    }

    /// The resolved archive paths, for callers that report what went where.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.nodes.keys().map(String::as_str)
    }
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TreeStats {
    pub files: u64,
    pub dirs: u64,
    pub symlinks: u64,
    /// Bytes of file content in the archive (base and overlay).
    pub file_bytes: u64,
    /// Base files with more than one link: stored once per name (newc hard links are not used).
    pub hardlinked: u64,
    pub excluded_entries: u64,
    pub excluded_bytes: u64,
    /// Block devices, FIFOs and sockets in the base tree, which images do not carry.
    pub skipped_special: u64,
}

/// Writes the archive of `base` (if any) minus `excludes`, plus `overlay`, into `out`.
pub fn write_archive<W: Write>(
    base: Option<&Path>,
    excludes: &Excludes,
    overlay: &Overlay,
    out: W,
) -> Result<(W, TreeStats)> {
    let mut w = CpioWriter::new(out);
    let mut stats = TreeStats::default();
    let mut pending = overlay.nodes.clone();
    if let Some(root) = base {
        walk(root, root, excludes, &mut pending, &mut w, &mut stats)?;
    }
    for (path, node) in &pending {
        write_node(&mut w, path, node, &mut stats)?;
    }
    Ok((w.finish().context("finishing the cpio archive")?, stats))
}

fn walk<W: Write>(
    root: &Path,
    dir: &Path,
    excludes: &Excludes,
    pending: &mut BTreeMap<String, Node>,
    w: &mut CpioWriter<W>,
    stats: &mut TreeStats,
) -> Result<()> {
    let mut names: Vec<String> = Vec::new();
    for e in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let name = e?.file_name();
        match name.to_str() {
            Some(n) => names.push(n.to_string()),
            None => bail!(
                "{}: file name {name:?} is not UTF-8",
                dir.join(&name).display()
            ),
        }
    }
    names.sort();
    for name in names {
        let path = dir.join(&name);
        let rel = path
            .strip_prefix(root)
            .expect("below root")
            .to_string_lossy()
            .into_owned();
        if excludes.matches(&rel) {
            let (n, bytes) = disk_usage(&path)?;
            stats.excluded_entries += n;
            stats.excluded_bytes += bytes;
            continue;
        }
        if let Some(node) = pending.remove(&rel) {
            write_node(w, &rel, &node, stats)?;
            if matches!(node, Node::Dir { .. }) {
                walk(root, &path, excludes, pending, w, stats)?;
            }
            continue;
        }
        let m = fs::symlink_metadata(&path)?;
        let ft = m.file_type();
        let mode = m.mode() & 0o7777;
        let ctx = || format!("adding {} to the archive", path.display());
        if ft.is_dir() {
            w.dir(&rel, mode).with_context(ctx)?;
            stats.dirs += 1;
            walk(root, &path, excludes, pending, w, stats)?;
        } else if ft.is_file() {
            let data = fs::read(&path).with_context(ctx)?;
            // newc stores a 32-bit mtime; clamp rather than wrap (pre-1970 or post-2106).
            let mtime = m.mtime().clamp(0, u32::MAX as i64) as u32;
            w.file_with_mtime(&rel, mode, mtime, &data)
                .with_context(ctx)?;
            stats.files += 1;
            stats.file_bytes += data.len() as u64;
            if m.nlink() > 1 {
                stats.hardlinked += 1;
            }
        } else if ft.is_symlink() {
            let target = fs::read_link(&path).with_context(ctx)?;
            let target = target
                .to_str()
                .with_context(|| format!("{}: symlink target is not UTF-8", path.display()))?;
            w.symlink(&rel, target).with_context(ctx)?;
            stats.symlinks += 1;
        } else if ft.is_char_device() {
            let (major, minor) = dev_numbers(m.rdev());
            w.char_device(&rel, mode, major, minor).with_context(ctx)?;
        } else {
            stats.skipped_special += 1;
        }
    }
    Ok(())
}

fn write_node<W: Write>(
    w: &mut CpioWriter<W>,
    path: &str,
    node: &Node,
    stats: &mut TreeStats,
) -> Result<()> {
    let ctx = || format!("adding /{path} to the archive");
    match node {
        Node::Dir { mode } => {
            w.dir(path, *mode).with_context(ctx)?;
            stats.dirs += 1;
        }
        Node::File { mode, data } => {
            w.file(path, *mode, data).with_context(ctx)?;
            stats.files += 1;
            stats.file_bytes += data.len() as u64;
        }
        Node::Symlink { target } => {
            w.symlink(path, target).with_context(ctx)?;
            stats.symlinks += 1;
        }
        Node::CharDevice { mode, major, minor } => w
            .char_device(path, *mode, *major, *minor)
            .with_context(ctx)?,
    }
    Ok(())
}

/// glibc's encoding of dev_t.
fn dev_numbers(rdev: u64) -> (u32, u32) {
    let major = ((rdev >> 8) & 0xfff) | ((rdev >> 32) & !0xfff);
    let minor = (rdev & 0xff) | ((rdev >> 12) & !0xff);
    (major as u32, minor as u32)
}

/// Entries and bytes below (and including) `path`, without following symlinks.
fn disk_usage(path: &Path) -> Result<(u64, u64)> {
    let m = fs::symlink_metadata(path)?;
    if !m.is_dir() {
        return Ok((1, if m.is_file() { m.size() } else { 0 }));
    }
    let (mut n, mut bytes) = (1, 0);
    for e in fs::read_dir(path)? {
        let (a, b) = disk_usage(&e?.path())?;
        n += a;
        bytes += b;
    }
    Ok((n, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpio::read_archive;

    fn merged_usr_tree() -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        let r = tmp.path();
        for d in ["usr/bin", "usr/lib", "usr/share/doc/python3", "etc"] {
            fs::create_dir_all(r.join(d)).unwrap();
        }
        std::os::unix::fs::symlink("usr/bin", r.join("bin")).unwrap();
        std::os::unix::fs::symlink("usr/lib", r.join("lib")).unwrap();
        fs::write(r.join("usr/bin/python3"), "py").unwrap();
        fs::write(r.join("usr/share/doc/python3/copyright"), "long text").unwrap();
        fs::write(r.join("etc/hostname"), "base").unwrap();
        tmp
    }

    #[test]
    fn overlay_follows_base_symlinks_and_replaces_files() {
        let tmp = merged_usr_tree();
        let root = tmp.path();
        let mut ov = Overlay::new(Some(root));
        let file = |d: &str| Node::File {
            mode: 0o644,
            data: d.as_bytes().to_vec(),
        };
        ov.add("/lib/modules/6.1/modules.dep", file("dep")).unwrap();
        ov.add("/etc/hostname", file("tine")).unwrap();
        ov.add("/init", file("#!/bin/sh")).unwrap();
        assert!(ov.exists("/bin/python3"));
        assert!(!ov.exists("/bin/sh"));
        assert!(ov.add("/usr/lib", file("x")).is_err());

        let ex = Excludes::new(true, &[]).unwrap();
        let (cpio, stats) = write_archive(Some(root), &ex, &ov, Vec::new()).unwrap();
        let entries = read_archive(&cpio).unwrap();
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert!(
            names.contains(&"usr/lib/modules/6.1/modules.dep"),
            "{names:?}"
        );
        assert!(!names.iter().any(|n| n.starts_with("lib/")), "{names:?}");
        assert!(!names.contains(&"usr/share/doc/python3/copyright"));
        assert!(names.contains(&"usr/share/doc"));
        let hostname: Vec<_> = entries
            .iter()
            .filter(|e| e.name == "etc/hostname")
            .collect();
        assert_eq!(hostname.len(), 1);
        assert_eq!(hostname[0].data, b"tine");
        let lib = entries.iter().find(|e| e.name == "lib").unwrap();
        assert_eq!(lib.data, b"usr/lib");
        assert_eq!(stats.excluded_entries, 2);
        assert_eq!(stats.excluded_bytes, 9);
    }

    #[test]
    fn base_files_keep_their_mtime_and_mode() {
        let tmp = merged_usr_tree();
        let f = tmp.path().join("usr/bin/python3");
        fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o4755)).unwrap();
        let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_650_000_000);
        fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(t)
            .unwrap();
        let (cpio, _) = write_archive(
            Some(tmp.path()),
            &Excludes::default(),
            &Overlay::new(Some(tmp.path())),
            Vec::new(),
        )
        .unwrap();
        let e = read_archive(&cpio)
            .unwrap()
            .into_iter()
            .find(|e| e.name == "usr/bin/python3")
            .unwrap();
        assert_eq!(e.mtime, 1_650_000_000);
        assert_eq!(e.mode & 0o7777, 0o4755);
    }

    #[test]
    fn archive_is_deterministic() {
        let tmp = merged_usr_tree();
        let pack = || {
            let mut ov = Overlay::new(Some(tmp.path()));
            ov.add("/etc/tine/agent.conf", Node::Dir { mode: 0o755 })
                .unwrap();
            write_archive(Some(tmp.path()), &Excludes::default(), &ov, Vec::new())
                .unwrap()
                .0
        };
        assert_eq!(pack(), pack());
    }

    #[test]
    fn dev_numbers_decode_like_glibc() {
        // glibc makedev(5, 1) and makedev(4096 + 3, 70000).
        assert_eq!(dev_numbers(0x501), (5, 1));
        let (major, minor) = (4099u64, 70000u64);
        let big = ((major & 0xfff) << 8)
            | ((major & !0xfff) << 32)
            | (minor & 0xff)
            | ((minor & !0xff) << 12);
        assert_eq!(dev_numbers(big), (4099, 70000));
    }
}
