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

/// Image pages (offset / 4096) that process `pid` has copied privately in its private
/// mappings of a file named `file_name`: present, and anonymous rather than the file's page.
pub fn written_pages(pid: u32, file_name: &str) -> io::Result<Vec<u64>> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let pagemap = std::fs::File::open(format!("/proc/{pid}/pagemap"))?;
    let mut out = Vec::new();
    for m in maps.lines().filter_map(Mapping::parse) {
        if !m.private || !m.path.ends_with(&format!("/{file_name}")) {
            continue;
        }
        let pages = (m.end - m.start) / PAGE;
        let mut buf = vec![0u8; (BATCH * 8) as usize];
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
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// One line of `/proc/<pid>/maps`.
struct Mapping<'a> {
    start: u64,
    end: u64,
    private: bool,
    offset: u64,
    path: &'a str,
}

impl<'a> Mapping<'a> {
    fn parse(line: &'a str) -> Option<Mapping<'a>> {
        let mut f = line.splitn(6, ' ');
        let (start, end) = f.next()?.split_once('-')?;
        let perms = f.next()?;
        let offset = f.next()?;
        let _dev = f.next()?;
        let _inode = f.next()?;
        Some(Mapping {
            start: u64::from_str_radix(start, 16).ok()?,
            end: u64::from_str_radix(end, 16).ok()?,
            private: perms.as_bytes().get(3) == Some(&b'p'),
            offset: u64::from_str_radix(offset, 16).ok()?,
            path: f.next().unwrap_or("").trim_start(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse() {
        let m = Mapping::parse(
            "7f0000000000-7f0000400000 rw-p 00200000 fd:01 1234      /snapshots/warm/memory.img",
        )
        .unwrap();
        assert_eq!(
            (m.start, m.end, m.offset),
            (0x7f00_0000_0000, 0x7f00_0040_0000, 0x20_0000)
        );
        assert!(m.private && m.path == "/snapshots/warm/memory.img");
        let anon = Mapping::parse("7f0000000000-7f0000001000 rw-s 00000000 00:00 0").unwrap();
        assert!(!anon.private && anon.path.is_empty());
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
        let got = written_pages(std::process::id(), "image.bin").unwrap();
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(p, len) };
        assert_eq!(got, [16 + 3, 16 + 20]);
    }
}
