//! Guest RAM pages a child copied but holds as its snapshot has them, given back to the
//! snapshot. A child maps its snapshot's image copy-on-write, so any write copies a page for it
//! alone, even one that leaves the page's bytes as they were: a lock taken and released, a
//! counter raised and lowered, a page table the CPU's walk wrote for its accessed bits, or a
//! page of the recorded working set copied ahead that this child never changed. Dropping such
//! a copy (`MADV_DONTNEED` on the private mapping) maps the image's page again, shared with
//! every child of the snapshot; the guest reads the same bytes, and its next write copies the
//! page again. Nothing else changes: a diff branch taken later holds the private pages, and a
//! page given back is the snapshot's, which the diff's parent holds.

use std::os::unix::fs::FileExt;

use crate::error::{MemoryError, Result};
use crate::memory::GuestRam;
use crate::snapshot::diff::{for_each_equal_stretch, private_runs_in, PageRun, PAGE};

/// What one pass found: the guest RAM pages this process held privately, and how many of
/// them it gave back for holding the snapshot's bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GivenBack {
    pub private_pages: u64,
    pub given_back: u64,
    /// How long the guest was paused for it (set by whoever paused it).
    pub paused: std::time::Duration,
}

/// Pages of the image read at a time to compare with.
const CHUNK_PAGES: u64 = 16;
/// Page map bytes read at a time: 8 per page of guest RAM.
const SCAN_BYTES: usize = 16 * 1024;

/// A buffer mapped for one pass and unmapped after it. A child's VMM keeps every page its
/// allocator ever touched, so a buffer from the heap would stay with the child for its life.
struct Scratch {
    ptr: *mut u8,
    len: usize,
}

impl Scratch {
    fn new(len: usize) -> std::io::Result<Scratch> {
        // SAFETY: a fresh private anonymous mapping, owned by the value returned.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Scratch {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl std::ops::Deref for Scratch {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: our mapping of `len` bytes, alive until drop.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref, and borrowed mutably through self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // SAFETY: unmapping exactly what new mapped; no borrow outlives self.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// The pages `ram` holds privately, to pass to [`give_back_unchanged`]: read while the guest
/// runs (the scan reads an entry per page of guest RAM), since a page the guest copies meanwhile
/// stays its own until given back. None for RAM not restored over a sole snapshot image
/// (booted, page-by-page, or with diff layers), where the image does not back every page.
pub fn private_pages(ram: &GuestRam) -> Result<Option<Vec<PageRun>>> {
    if ram.sole_image().is_none() {
        return Ok(None);
    }
    let io = |step| move |source| MemoryError::GiveBack { step, source };
    let mut buf = Scratch::new(SCAN_BYTES).map_err(io("a buffer for /proc/self/pagemap"))?;
    let runs = private_runs_in(ram, &mut buf).map_err(io("reading /proc/self/pagemap"))?;
    Ok(Some(runs))
}

/// Give back those of the pages of `runs` (see [`private_pages`]) whose bytes equal the image's
/// at their place. Nothing may write guest RAM meanwhile: the vCPUs and devices are paused.
pub fn give_back_unchanged(ram: &GuestRam, runs: &[PageRun]) -> Result<GivenBack> {
    let image = ram.sole_image().ok_or(MemoryError::GiveBack {
        step: "finding the snapshot's image",
        source: std::io::Error::other("guest RAM is no longer over a sole image"),
    })?;
    let mut found = GivenBack::default();
    let mut file_bytes =
        Scratch::new((CHUNK_PAGES * PAGE) as usize).map_err(|source| MemoryError::GiveBack {
            step: "a buffer for the image's pages",
            source,
        })?;
    for run in runs {
        found.private_pages += run.count;
        let mut done = 0;
        while done < run.count {
            let piece = PageRun {
                first: run.first + done,
                count: (run.count - done).min(CHUNK_PAGES),
            };
            let bytes = &mut file_bytes[..piece.len() as usize];
            image
                .read_exact_at(bytes, piece.offset())
                .map_err(|source| MemoryError::GiveBack {
                    step: "reading the snapshot's memory image",
                    source,
                })?;
            found.given_back += give_back_equal(ram, piece, bytes)?;
            done += piece.count;
        }
    }
    Ok(found)
}

/// Drop this process's copies of the pages of `piece` that equal `image` (the image's bytes
/// at its place), one call per stretch of equal pages; returns how many.
fn give_back_equal(ram: &GuestRam, piece: PageRun, image: &[u8]) -> Result<u64> {
    // Nothing writes guest RAM meanwhile.
    let held = ram.run_bytes(piece)?;
    let host = held.as_ptr() as *mut u8;
    let mut given = 0;
    for_each_equal_stretch(held, image, |start, count| {
        // SAFETY: pages of our own private RAM mapping that hold what the image holds there:
        // dropping the copy maps the image's page, with the same bytes.
        let rc = unsafe {
            libc::madvise(
                host.add((start * PAGE) as usize).cast(),
                (count * PAGE) as usize,
                libc::MADV_DONTNEED,
            )
        };
        if rc != 0 {
            return Err(MemoryError::Advise {
                advice: "MADV_DONTNEED",
                guest_addr: piece.offset() + start * PAGE,
                source: std::io::Error::last_os_error(),
            });
        }
        given += count;
        Ok(())
    })?;
    Ok(given)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Origin, Sharing};
    use crate::snapshot::diff::{private_runs, Overlay};
    use std::io::Write;
    use vm_memory::{Bytes, GuestAddress};

    const MIB: u64 = 1 << 20;

    /// A 32 MiB image whose page `p` is filled with byte `p % 251`.
    fn image() -> std::fs::File {
        let mut f = tempfile::tempfile().unwrap();
        for p in 0..(32 * MIB / PAGE) {
            f.write_all(&[(p % 251) as u8; PAGE as usize]).unwrap();
        }
        f
    }

    fn origin() -> Origin {
        Origin {
            dir: "/snapshots/warm".into(),
            state_sha256: "0".repeat(64),
        }
    }

    fn page_byte(p: u64) -> u8 {
        (p % 251) as u8
    }

    #[test]
    fn only_copies_that_hold_the_image_s_bytes_are_given_back() {
        let ram = GuestRam::from_chain(image(), 32 * MIB, Vec::new(), origin()).unwrap();
        let mem = ram.memory();
        // Pages 10 and 11 written back as they were (a stretch), 20 changed, and 30 changed in
        // one byte only.
        for p in [10u64, 11] {
            mem.write_slice(&[page_byte(p); 8], GuestAddress(p * PAGE + 100))
                .unwrap();
        }
        mem.write_obj(0xEEu8, GuestAddress(20 * PAGE)).unwrap();
        mem.write_obj(
            page_byte(30).wrapping_add(1),
            GuestAddress(30 * PAGE + 4095),
        )
        .unwrap();
        let private =
            |ram: &GuestRam| crate::snapshot::diff::page_count(&private_runs(ram).unwrap());
        assert_eq!(private(&ram), 4);

        let runs = private_pages(&ram).unwrap().expect("a sole image");
        let found = give_back_unchanged(&ram, &runs).unwrap();
        assert_eq!(
            found,
            GivenBack {
                private_pages: 4,
                given_back: 2,
                paused: std::time::Duration::ZERO,
            }
        );
        assert_eq!(
            private(&ram),
            2,
            "the changed pages stay this process's own"
        );
        // The guest reads what it read before, from every page.
        let read = |at: u64| mem.read_obj::<u8>(GuestAddress(at)).unwrap();
        assert_eq!(read(10 * PAGE + 100), page_byte(10));
        assert_eq!(read(11 * PAGE), page_byte(11));
        assert_eq!(read(20 * PAGE), 0xEE);
        assert_eq!(read(30 * PAGE + 4095), page_byte(30).wrapping_add(1));
        // A page given back is copied again by its next write, and the image is untouched.
        mem.write_obj(0x55u8, GuestAddress(10 * PAGE)).unwrap();
        assert_eq!(private(&ram), 3);
        let mut b = [0u8; 1];
        ram.file()
            .unwrap()
            .read_exact_at(&mut b, 10 * PAGE)
            .unwrap();
        assert_eq!(b[0], page_byte(10));
    }

    #[test]
    fn ram_not_over_a_sole_image_is_left_alone() {
        // Booted RAM: shared with its file, so nothing is private and the file is the guest's.
        let booted = GuestRam::from_file(image(), 32 * MIB, Sharing::Shared).unwrap();
        assert_eq!(private_pages(&booted).unwrap(), None);
        // A diff layer over the image: its pages are not the image's.
        let mut layer = tempfile::tempfile().unwrap();
        layer.write_all(&[7u8; PAGE as usize]).unwrap();
        let overlay = Overlay {
            file: layer,
            runs: vec![PageRun { first: 5, count: 1 }],
        };
        let layered = GuestRam::from_chain(image(), 32 * MIB, vec![overlay], origin()).unwrap();
        layered
            .memory()
            .write_obj(7u8, GuestAddress(5 * PAGE))
            .unwrap();
        assert_eq!(private_pages(&layered).unwrap(), None);
        assert_eq!(
            crate::snapshot::diff::page_count(&private_runs(&layered).unwrap()),
            1
        );
    }
}
