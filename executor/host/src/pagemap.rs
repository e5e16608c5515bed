//! Which pages of its memory image a running child has written: the pages it holds as private
//! copies in its copy-on-write mappings of the image, read from `/proc/<pid>/pagemap`.

use std::io;
use std::os::unix::fs::FileExt;

const PAGE: u64 = 4096;
/// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PRESENT: u64 = 1 << 63;
const FILE_OR_SHARED: u64 = 1 << 61;
/// Entries read per call: 512 KiB of pagemap, 256 MiB of mapping.
const BATCH: u64 = 64 * 1024;

/// Pages of `file` (offset / 4096) that process `pid` has copied privately in its private
/// mappings of it: present, and anonymous rather than the file's page. Mappings are matched by
/// device and inode (the process may see the file under another path, or a symlink's
/// target); none matching is an error, not "nothing written".
pub fn written_pages(pid: u32, file: &std::path::Path) -> io::Result<Vec<u64>> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(file)?;
    let id = FileId {
        major: libc::major(meta.dev()) as u64,
        minor: libc::minor(meta.dev()) as u64,
        inode: meta.ino(),
    };
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut out = Vec::new();
    let mut matched = false;
    let mut buf = vec![0u8; (BATCH * 8) as usize];
    for m in maps.lines().filter_map(Mapping::parse) {
        if !m.private || m.file != Some(id) {
            continue;
        }
        matched = true;
        let pages = (m.end - m.start) / PAGE;
        let mut done = 0;
        while done < pages {
            let n = BATCH.min(pages - done);
            let b = &mut buf[..(n * 8) as usize];
            pagemap.read_exact_at(b, (m.start / PAGE + done) * 8)?;
            for (i, e) in b.chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(e.try_into().expect("8 bytes"));
                if e & PRESENT != 0 && e & FILE_OR_SHARED == 0 {
                    out.push(m.offset / PAGE + done + i as u64);
                }
            }
            done += n;
        }
    }
    if !matched {
        return Err(io::Error::other(format!(
            "process {pid} maps no part of {}",
            file.display()
        )));
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// A file as `/proc/<pid>/maps` names it: device (major, minor) and inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId {
    major: u64,
    minor: u64,
    inode: u64,
}

/// One line of `/proc/<pid>/maps`.
struct Mapping {
    start: u64,
    end: u64,
    private: bool,
    offset: u64,
    /// None for an anonymous mapping (inode 0).
    file: Option<FileId>,
}

impl Mapping {
    fn parse(line: &str) -> Option<Mapping> {
        let mut f = line.split_ascii_whitespace();
        let (start, end) = f.next()?.split_once('-')?;
        let perms = f.next()?;
        let offset = f.next()?;
        let (major, minor) = f.next()?.split_once(':')?;
        let inode: u64 = f.next()?.parse().ok()?;
        let file = FileId {
            major: u64::from_str_radix(major, 16).ok()?,
            minor: u64::from_str_radix(minor, 16).ok()?,
            inode,
        };
        Some(Mapping {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            private: perms.as_bytes().get(3) == Some(&b'p'),
            offset: u64::from_str_radix(offset, 16).ok()?,
            file: (inode != 0).then_some(file),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse() {
        let m = Mapping::parse(
            "7f0000000000-7f0000400000 rw-p 00200000 fd:1a 1234      /snapshots/warm/memory.img",
        )
        .unwrap();
        assert_eq!(
            (m.start, m.end, m.offset),
            (0x7f00_0000_0000, 0x7f00_0040_0000, 0x20_0000)
        );
        let id = FileId {
            major: 0xfd,
            minor: 0x1a,
            inode: 1234,
        };
        assert!(m.private && m.file == Some(id));
        let anon = Mapping::parse("7f0000000000-7f0000001000 rw-s 00000000 00:00 0").unwrap();
        assert!(!anon.private && anon.file.is_none());
        assert!(Mapping::parse("garbage").is_none());
    }

    /// Our own private mapping of a file: the pages we wrote, and only those, are found.
    #[test]
    fn written_pages_of_a_private_file_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("image.bin");
        std::fs::write(&path, vec![7u8; 64 * PAGE as usize]).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        use std::os::fd::AsRawFd;
        let len = 32 * PAGE as usize;
        // SAFETY: a fresh private mapping of 32 pages at file offset 16 pages, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                f.as_raw_fd(),
                (16 * PAGE) as libc::off_t,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let bytes = p.cast::<u8>();
        // SAFETY: inside the mapping.
        unsafe {
            let _read = std::ptr::read_volatile(bytes.add(PAGE as usize));
            bytes.add(3 * PAGE as usize).write_volatile(1);
            bytes.add(20 * PAGE as usize + 5).write_volatile(2);
        }
        // Under another name too, as a confined VMM or a fetched snapshot's symlink shows it.
        let link = dir.path().join("memory.img");
        std::os::unix::fs::symlink(&path, &link).unwrap();
        let got = written_pages(std::process::id(), &link).unwrap();
        let other = dir.path().join("other.bin");
        std::fs::write(&other, b"x").unwrap();
        let unmapped = written_pages(std::process::id(), &other).unwrap_err();
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, len) };
        assert_eq!(got, [16 + 3, 16 + 20]);
        assert!(
            unmapped.to_string().contains("maps no part of"),
            "{unmapped}"
        );
    }
}
