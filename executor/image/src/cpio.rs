//! A writer for `newc` cpio archives (the format the Linux initramfs unpacker reads).
//!
//! Entries get mtime 0 (unless the caller passes one), uid/gid 0 and sequential inode numbers, so the same inputs always give
//! the same bytes (which makes archives cacheable by content). Missing parent directories are
//! added automatically, because the kernel's unpacker does not create them.

use std::collections::BTreeSet;
use std::io::{self, Write};

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;
const TRAILER: &str = "TRAILER!!!";

pub struct CpioWriter<W: Write> {
    out: W,
    written: u64,
    next_ino: u32,
    dirs: BTreeSet<String>,
}

struct Header<'a> {
    name: &'a str,
    mode: u32,
    nlink: u32,
    size: u32,
    mtime: u32,
    rdev: (u32, u32),
}

impl<W: Write> CpioWriter<W> {
    pub fn new(out: W) -> Self {
        CpioWriter {
            out,
            written: 0,
            next_ino: 1,
            dirs: BTreeSet::new(),
        }
    }

    /// A directory (and any missing parents).
    pub fn dir(&mut self, path: &str, mode: u32) -> io::Result<()> {
        let path = normalize(path)?;
        if path.is_empty() || self.dirs.contains(&path) {
            return Ok(());
        }
        self.parents(&path)?;
        self.entry(
            Header {
                name: &path,
                mode: S_IFDIR | (mode & 0o7777),
                nlink: 2,
                size: 0,
                mtime: 0,
                rdev: (0, 0),
            },
            &[],
        )?;
        self.dirs.insert(path);
        Ok(())
    }

    /// A regular file with permission bits `mode`.
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.file_with_mtime(path, mode, 0, data)
    }

    /// A regular file that keeps its modification time: Python trusts a `.pyc` only while its
    /// source's mtime matches the one recorded inside it, so root filesystems need real mtimes.
    pub fn file_with_mtime(
        &mut self,
        path: &str,
        mode: u32,
        mtime: u32,
        data: &[u8],
    ) -> io::Result<()> {
        let path = normalize(path)?;
        let size = u32::try_from(data.len())
            .map_err(|_| invalid(format!("{path}: newc cannot hold files of 4 GiB or more")))?;
        self.parents(&path)?;
        self.entry(
            Header {
                name: &path,
                mode: S_IFREG | (mode & 0o7777),
                nlink: 1,
                size,
                mtime,
                rdev: (0, 0),
            },
            data,
        )
    }

    /// A symbolic link at `path` pointing to `target`.
    pub fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        let path = normalize(path)?;
        self.parents(&path)?;
        self.entry(
            Header {
                name: &path,
                mode: S_IFLNK | 0o777,
                nlink: 1,
                size: target.len() as u32,
                mtime: 0,
                rdev: (0, 0),
            },
            target.as_bytes(),
        )
    }

    /// A character device node, e.g. `/dev/console` = (5, 1).
    pub fn char_device(&mut self, path: &str, mode: u32, major: u32, minor: u32) -> io::Result<()> {
        let path = normalize(path)?;
        self.parents(&path)?;
        self.entry(
            Header {
                name: &path,
                mode: S_IFCHR | (mode & 0o7777),
                nlink: 1,
                size: 0,
                mtime: 0,
                rdev: (major, minor),
            },
            &[],
        )
    }

    /// Writes the trailer and returns the underlying writer.
    pub fn finish(mut self) -> io::Result<W> {
        self.entry(
            Header {
                name: TRAILER,
                mode: 0,
                nlink: 1,
                size: 0,
                mtime: 0,
                rdev: (0, 0),
            },
            &[],
        )?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn parents(&mut self, path: &str) -> io::Result<()> {
        if let Some((parent, _)) = path.rsplit_once('/') {
            if !self.dirs.contains(parent) {
                self.dir(parent, 0o755)?;
            }
        }
        Ok(())
    }

    fn entry(&mut self, h: Header<'_>, data: &[u8]) -> io::Result<()> {
        let ino = if h.name == TRAILER { 0 } else { self.next_ino };
        self.next_ino += 1;
        let fields = [
            ino,
            h.mode,
            0, // uid
            0, // gid
            h.nlink,
            h.mtime,
            h.size,
            0, // devmajor
            0, // devminor
            h.rdev.0,
            h.rdev.1,
            h.name.len() as u32 + 1,
            0, // check
        ];
        let mut header = String::with_capacity(110);
        header.push_str("070701");
        for f in fields {
            header.push_str(&format!("{f:08x}"));
        }
        self.put(header.as_bytes())?;
        self.put(h.name.as_bytes())?;
        self.put(&[0])?;
        self.pad()?;
        self.put(data)?;
        self.pad()
    }

    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let n = (4 - (self.written % 4) as usize) % 4;
        self.put(&[0; 3][..n])
    }
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg)
}

/// Archive names are relative ("bin/sh"); reject anything that could escape the root.
fn normalize(path: &str) -> io::Result<String> {
    let parts: Vec<&str> = path
        .split('/')
        .filter(|p| !p.is_empty() && *p != ".")
        .collect();
    if parts.contains(&"..") {
        return Err(invalid(format!("{path:?}: '..' is not allowed")));
    }
    if parts.iter().any(|p| p.contains('\0')) {
        return Err(invalid(format!("{path:?}: NUL in name")));
    }
    Ok(parts.join("/"))
}

/// A parsed archive entry (used by tests and by tools that inspect images).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    pub mode: u32,
    pub mtime: u32,
    pub rdev: (u32, u32),
    pub data: Vec<u8>,
}

/// Parses a `newc` archive up to its trailer.
pub fn read_archive(mut data: &[u8]) -> io::Result<Vec<Entry>> {
    let total = data.len();
    let mut entries = Vec::new();
    let bad = |msg: &str, at: usize| invalid(format!("cpio at byte {at}: {msg}"));
    loop {
        let at = total - data.len();
        if data.len() < 110 || &data[..6] != b"070701" {
            return Err(bad("bad header", at));
        }
        let field = |i: usize| -> io::Result<u32> {
            let s = std::str::from_utf8(&data[6 + i * 8..14 + i * 8])
                .map_err(|_| bad("non-ASCII field", at))?;
            u32::from_str_radix(s, 16).map_err(|_| bad("non-hex field", at))
        };
        let (mode, mtime, size, rmaj, rmin, namesize) = (
            field(1)?,
            field(5)?,
            field(6)? as usize,
            field(9)?,
            field(10)?,
            field(11)? as usize,
        );
        let name_end = 110 + namesize;
        let data_start = name_end.next_multiple_of(4);
        let data_end = data_start + size;
        if namesize == 0 || data.len() < data_end {
            return Err(bad("truncated entry", at));
        }
        let name = String::from_utf8_lossy(&data[110..name_end - 1]).into_owned();
        if name == TRAILER {
            return Ok(entries);
        }
        entries.push(Entry {
            name,
            mode,
            mtime,
            rdev: (rmaj, rmin),
            data: data[data_start..data_end].to_vec(),
        });
        data = &data[data_end.next_multiple_of(4).min(data.len())..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<u8> {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("/dev", 0o755).unwrap();
        w.char_device("/dev/console", 0o600, 5, 1).unwrap();
        w.file("/bin/busybox", 0o755, b"\x7fELF fake").unwrap();
        w.symlink("/bin/sh", "busybox").unwrap();
        w.file("etc/deep/nested/file", 0o644, b"x").unwrap();
        w.file("/init", 0o755, b"#!/bin/sh\necho hi\n").unwrap();
        w.file_with_mtime("/lib/x.py", 0o644, 1_700_000_000, b"x = 1\n")
            .unwrap();
        w.finish().unwrap()
    }

    #[test]
    fn round_trips_through_our_reader() {
        let entries = read_archive(&sample()).unwrap();
        let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "dev",
                "dev/console",
                "bin",
                "bin/busybox",
                "bin/sh",
                "etc",
                "etc/deep",
                "etc/deep/nested",
                "etc/deep/nested/file",
                "init",
                "lib",
                "lib/x.py"
            ]
        );
        assert_eq!(entries[11].mtime, 1_700_000_000);
        assert_eq!(entries[9].mtime, 0);
        let console = &entries[1];
        assert_eq!(console.mode, S_IFCHR | 0o600);
        assert_eq!(console.rdev, (5, 1));
        assert_eq!(entries[4].mode, S_IFLNK | 0o777);
        assert_eq!(entries[4].data, b"busybox");
        assert_eq!(entries[9].data, b"#!/bin/sh\necho hi\n");
        assert_eq!(entries[9].mode, S_IFREG | 0o755);
    }

    #[test]
    fn archive_is_deterministic_and_aligned() {
        let a = sample();
        assert_eq!(a, sample());
        assert_eq!(a.len() % 4, 0);
    }

    #[test]
    fn rejects_escaping_names() {
        let mut w = CpioWriter::new(Vec::new());
        assert!(w.file("../etc/passwd", 0o644, b"").is_err());
    }

    /// Debian's `cpio` must agree with our idea of the format.
    #[test]
    fn debian_cpio_lists_the_archive() {
        use std::process::{Command, Stdio};
        let mut child = match Command::new("cpio")
            .args(["-t", "-v", "--quiet"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => {
                eprintln!("cpio not available ({e}); skipped");
                return;
            }
        };
        child.stdin.take().unwrap().write_all(&sample()).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let listing = String::from_utf8(out.stdout).unwrap();
        let line = |name: &str| {
            listing
                .lines()
                .find(|l| l.ends_with(name) || l.contains(&format!("{name} -> ")))
                .unwrap_or_else(|| panic!("{name} missing from:\n{listing}"))
                .to_string()
        };
        assert!(line("dev/console").starts_with("crw-------"));
        assert!(line("dev/console").contains("5,"));
        assert!(line("bin/sh").starts_with("lrwxrwxrwx"));
        assert!(line("bin/sh").ends_with("bin/sh -> busybox"));
        assert!(line("init").starts_with("-rwxr-xr-x"));
        assert!(line("etc/deep/nested").starts_with("drwxr-xr-x"));
    }
}
