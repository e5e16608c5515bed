//! Unpacking root filesystem tarballs without letting them write outside their directory.
//!
//! Refused, with an error naming the entry: absolute paths, `..` components, symlinks whose
//! target leaves the root (resolved as the guest would: absolute targets start at the root),
//! hard links to anything but an earlier regular file, and entries that would be written through
//! a symlink. Device nodes and FIFOs are skipped (the agent mounts devtmpfs on /dev).

use std::fs::{self, File};
use std::io::{BufReader, Read};
use std::path::{Component, Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{bail, Context, Result};
use tar::EntryType;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct UnpackStats {
    pub entries: u64,
    pub skipped_special: u64,
}

/// Unpacks `tarball` (plain, gzip, zstd or xz, by magic number) into the existing `dest`.
pub fn unpack(tarball: &Path, dest: &Path) -> Result<UnpackStats> {
    let what = || format!("unpacking {}", tarball.display());
    let mut f = File::open(tarball).with_context(|| format!("opening {}", tarball.display()))?;
    let mut magic = [0u8; 6];
    let n = f.read(&mut magic)?;
    drop(f);
    let file = BufReader::new(File::open(tarball)?);
    let magic = &magic[..n];
    if magic.starts_with(&[0x1f, 0x8b]) {
        unpack_from(flate2::read::GzDecoder::new(file), dest).with_context(what)
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        unpack_from(zstd::stream::Decoder::new(file)?, dest).with_context(what)
    } else if magic.starts_with(b"\xfd7zXZ\0") {
        let mut child = XzChild::spawn(tarball)?;
        let stats = unpack_from(child.stdout()?, dest).with_context(what)?;
        child.finish()?;
        Ok(stats)
    } else {
        unpack_from(file, dest).with_context(what)
    }
}

struct XzChild(Child);

impl XzChild {
    fn spawn(path: &Path) -> Result<XzChild> {
        Command::new("xz")
            .arg("-dc")
            .arg(path)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .map(XzChild)
            .context("running xz -dc (package xz-utils)")
    }
    fn stdout(&mut self) -> Result<impl Read> {
        self.0.stdout.take().context("xz stdout")
    }
    fn finish(mut self) -> Result<()> {
        let status = self.0.wait()?;
        if !status.success() {
            bail!("xz -dc failed ({status})");
        }
        Ok(())
    }
}

impl Drop for XzChild {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Unpacks a tar stream into `dest`, validating every entry before touching the disk.
pub fn unpack_from(reader: impl Read, dest: &Path) -> Result<UnpackStats> {
    let mut archive = tar::Archive::new(reader);
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_preserve_ownerships(false);
    let mut stats = UnpackStats::default();
    for entry in archive.entries().context("reading the tar stream")? {
        let mut entry = entry.context("reading a tar entry")?;
        let raw = entry.path_bytes().into_owned();
        let name = String::from_utf8_lossy(&raw).into_owned();
        let rel = checked_relative(&name)?;
        let kind = entry.header().entry_type();
        if rel.as_os_str().is_empty() {
            continue; // "./" itself
        }
        match kind {
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                stats.skipped_special += 1;
                continue;
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .with_context(|| format!("tar entry {name:?}: symlink without a target"))?;
                check_symlink_target(&rel, &String::from_utf8_lossy(&target))
                    .with_context(|| format!("tar entry {name:?}"))?;
            }
            EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .with_context(|| format!("tar entry {name:?}: hard link without a target"))?;
                let target = String::from_utf8_lossy(&target).into_owned();
                let target_rel = checked_relative(&target)
                    .with_context(|| format!("tar entry {name:?}: hard link target"))?;
                refuse_symlinked_parents(dest, &target_rel)
                    .with_context(|| format!("tar entry {name:?}"))?;
                let meta = fs::symlink_metadata(dest.join(&target_rel)).ok();
                if !meta.is_some_and(|m| m.is_file()) {
                    bail!(
                        "tar entry {name:?}: hard link to {target:?}, which is not an earlier regular file"
                    );
                }
            }
            EntryType::Regular
            | EntryType::Directory
            | EntryType::Continuous
            | EntryType::GNUSparse => {}
            // Metadata records (pax, GNU long names) are consumed by the tar reader itself.
            EntryType::XGlobalHeader | EntryType::XHeader => continue,
            other => bail!("tar entry {name:?}: unsupported entry type {other:?}"),
        }
        refuse_symlinked_parents(dest, &rel).with_context(|| format!("tar entry {name:?}"))?;
        let full = dest.join(&rel);
        if let Some(parent) = full.parent() {
            fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        // Never write through an existing symlink (or replace a file by a directory silently).
        if let Ok(m) = fs::symlink_metadata(&full) {
            if kind == EntryType::Directory {
                if !m.is_dir() {
                    bail!("tar entry {name:?}: a directory over an earlier non-directory");
                }
            } else if m.is_dir() {
                bail!("tar entry {name:?}: a file over an earlier directory");
            } else {
                fs::remove_file(&full)?;
            }
        }
        if kind == EntryType::Link {
            // tar's own unpack resolves link targets against the working directory; do it here.
            let target =
                String::from_utf8_lossy(&entry.link_name_bytes().unwrap_or_default()).into_owned();
            fs::hard_link(dest.join(checked_relative(&target)?), &full)
                .with_context(|| format!("tar entry {name:?}: linking {}", full.display()))?;
        } else {
            entry
                .unpack(&full)
                .with_context(|| format!("tar entry {name:?}: writing {}", full.display()))?;
        }
        stats.entries += 1;
    }
    Ok(stats)
}

/// The entry's path relative to the root; absolute paths and `..` are refused.
fn checked_relative(name: &str) -> Result<PathBuf> {
    if name.starts_with('/') {
        bail!("tar entry {name:?}: absolute path");
    }
    if name.contains('\0') {
        bail!("tar entry {name:?}: NUL in the name");
    }
    let mut out = PathBuf::new();
    for c in Path::new(name).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir => {}
            Component::ParentDir => bail!("tar entry {name:?}: '..' in the path"),
            Component::RootDir | Component::Prefix(_) => {
                bail!("tar entry {name:?}: absolute path")
            }
        }
    }
    Ok(out)
}

/// A symlink at `link` (relative to the root) pointing at `target` must stay inside the root.
fn check_symlink_target(link: &Path, target: &str) -> Result<()> {
    if target.is_empty() || target.contains('\0') {
        bail!("symlink with an empty or NUL-containing target");
    }
    let mut depth: i64 = if target.starts_with('/') {
        0
    } else {
        link.components().count() as i64 - 1
    };
    for part in target.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                depth -= 1;
                if depth < 0 {
                    bail!("symlink to {target:?} escapes the root filesystem");
                }
            }
            _ => depth += 1,
        }
    }
    Ok(())
}

/// Refuses `rel` if any directory on its way (inside `dest`) is a symlink.
fn refuse_symlinked_parents(dest: &Path, rel: &Path) -> Result<()> {
    let mut here = dest.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for c in &parts[..parts.len().saturating_sub(1)] {
        here.push(c);
        if fs::symlink_metadata(&here).is_ok_and(|m| m.file_type().is_symlink()) {
            bail!(
                "would be written through the symlink {}",
                here.strip_prefix(dest).unwrap_or(&here).display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(kind: EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_mtime(1_700_000_000);
        h
    }

    /// Writes a raw name into the header, bypassing the tar crate's own path checks: hostile
    /// archives are not made by well-behaved writers.
    fn raw_name(h: &mut tar::Header, name: &str) {
        let field = &mut h.as_old_mut().name;
        field.fill(0);
        field[..name.len()].copy_from_slice(name.as_bytes());
    }

    enum E<'a> {
        File(&'a str, &'a [u8]),
        Dir(&'a str),
        Symlink(&'a str, &'a str),
        Hardlink(&'a str, &'a str),
    }

    fn archive(entries: &[E]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for e in entries {
            match e {
                E::File(name, data) => {
                    let mut h = header(EntryType::Regular, 0o755, data.len() as u64);
                    raw_name(&mut h, name);
                    h.set_cksum();
                    b.append(&h, *data).unwrap();
                }
                E::Dir(name) => {
                    let mut h = header(EntryType::Directory, 0o755, 0);
                    raw_name(&mut h, name);
                    h.set_cksum();
                    b.append(&h, &[][..]).unwrap();
                }
                E::Symlink(name, target) | E::Hardlink(name, target) => {
                    let kind = if matches!(e, E::Symlink(..)) {
                        EntryType::Symlink
                    } else {
                        EntryType::Link
                    };
                    let mut h = header(kind, 0o777, 0);
                    raw_name(&mut h, name);
                    let link = &mut h.as_old_mut().linkname;
                    link[..target.len()].copy_from_slice(target.as_bytes());
                    h.set_cksum();
                    b.append(&h, &[][..]).unwrap();
                }
            }
        }
        b.into_inner().unwrap()
    }

    fn try_unpack(entries: &[E]) -> (tempfile::TempDir, Result<UnpackStats>) {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        fs::create_dir(&root).unwrap();
        let r = unpack_from(&archive(entries)[..], &root);
        (tmp, r)
    }

    #[test]
    fn unpacks_an_ordinary_tree() {
        let (tmp, r) = try_unpack(&[
            E::Dir("./usr/"),
            E::Dir("./usr/bin/"),
            E::File("./usr/bin/tool", b"#!/bin/sh\n"),
            E::Symlink("./bin", "usr/bin"),
            E::Symlink("./usr/bin/abs", "/usr/bin/tool"),
            E::Symlink("./usr/bin/rel", "../../usr/bin/tool"),
            E::Hardlink("./usr/bin/tool2", "./usr/bin/tool"),
        ]);
        assert_eq!(r.unwrap().entries, 7);
        let root = tmp.path().join("root");
        assert_eq!(
            fs::read(root.join("usr/bin/tool2")).unwrap(),
            b"#!/bin/sh\n"
        );
        assert_eq!(
            fs::read_link(root.join("bin")).unwrap(),
            Path::new("usr/bin")
        );
        use std::os::unix::fs::MetadataExt;
        let m = fs::metadata(root.join("usr/bin/tool")).unwrap();
        assert_eq!(m.mode() & 0o777, 0o755);
        assert_eq!(m.mtime(), 1_700_000_000);
    }

    #[test]
    fn hostile_entries_are_refused_by_name() {
        let cases: Vec<(Vec<E>, &str)> = vec![
            (vec![E::File("/etc/passwd", b"x")], "absolute path"),
            (vec![E::File("../outside", b"x")], "'..'"),
            (vec![E::File("a/../../outside", b"x")], "'..'"),
            (vec![E::Symlink("evil", "../..")], "escapes"),
            (vec![E::Symlink("a/b/evil", "../../../etc")], "escapes"),
            (
                vec![E::Symlink("sub", "/"), E::File("sub/x", b"x")],
                "through the symlink sub",
            ),
            (vec![E::Hardlink("h", "/etc/shadow")], "absolute path"),
            (
                vec![E::Hardlink("h", "nothing-here")],
                "not an earlier regular file",
            ),
        ];
        for (entries, want) in cases {
            let (tmp, r) = try_unpack(&entries);
            let err = format!("{:#}", r.unwrap_err());
            assert!(err.contains(want), "want {want:?} in: {err}");
            assert!(
                !tmp.path().join("outside").exists(),
                "an entry escaped: {err}"
            );
        }
    }

    #[test]
    fn files_never_follow_an_existing_symlink() {
        // A symlink to a host path that is harmless inside the guest (absolute targets start at
        // the guest root), then a file of the same name: the file replaces the link.
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        let (tmp2, r) = try_unpack(&[
            E::Symlink("x", outside.to_str().unwrap().trim_start_matches('/')),
            E::File("x", b"inside"),
        ]);
        r.unwrap();
        assert_eq!(fs::read(tmp2.path().join("root/x")).unwrap(), b"inside");
        assert!(!outside.exists());
    }

    #[test]
    fn compressed_tarballs_are_detected() {
        let tmp = tempfile::tempdir().unwrap();
        let tar = archive(&[E::File("hello", b"world")]);
        for (name, data) in [
            ("t.tar", tar.clone()),
            ("t.tar.gz", {
                let mut out = Vec::new();
                crate::compress::Compression::Gzip
                    .compress(&tar[..], &mut out)
                    .unwrap();
                out
            }),
            ("t.tar.zst", {
                let mut out = Vec::new();
                crate::compress::Compression::Zstd
                    .compress(&tar[..], &mut out)
                    .unwrap();
                out
            }),
        ] {
            let path = tmp.path().join(name);
            fs::write(&path, data).unwrap();
            let dest = tmp.path().join(format!("{name}.d"));
            fs::create_dir(&dest).unwrap();
            unpack(&path, &dest).unwrap();
            assert_eq!(fs::read(dest.join("hello")).unwrap(), b"world", "{name}");
        }
    }
}
