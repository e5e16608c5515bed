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

/// What one pass found and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GivenBack {
    /// Guest RAM pages this process held privately.
    pub private_pages: u64,
    /// Of those, the pages equal to the image's while the guest ran.
    pub candidates: u64,
    /// Of those, the pages still equal with the guest paused, and given back.
    pub given_back: u64,
    /// How many times the guest was paused, and the longest of those pauses.
    pub pauses: u32,
    pub paused: std::time::Duration,
}

impl GivenBack {
    /// More private pages than a pass looks at ([`MAX_PRIVATE_PAGES`]): none compared.
    pub fn skipped(&self) -> bool {
        self.private_pages > MAX_PRIVATE_PAGES
    }
}

/// The most private pages a pass looks at (64 MiB). A child that copied more is busy rather
/// than idle, and comparing them all would hold the VMM's main thread, which also serves the
/// devices, for that long.
pub const MAX_PRIVATE_PAGES: u64 = 16 * 1024;
/// Pages compared again and given back per pause of the guest.
pub const STEP_PAGES: u64 = 256;

/// What [`scan`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Scan {
    /// The RAM is not mapped over a sole snapshot image: nothing can be given back.
    NotSole,
    /// More than [`MAX_PRIVATE_PAGES`] private pages: not compared.
    TooMany { private_pages: u64 },
    /// The private pages, and those of them equal to the image's at the scan.
    Candidates {
        private_pages: u64,
        equal: Vec<PageRun>,
    },
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

/// While the guest runs: the pages `ram` holds privately, and which of them equal the image's
/// now. A page the guest copies or changes after this is only left out or compared again under
/// the pause ([`give_back_unchanged`]), so nothing here needs the guest to stand still; its
/// pages are read through volatile copies.
pub fn scan(ram: &GuestRam) -> Result<Scan> {
    let Some(image) = ram.sole_image() else {
        return Ok(Scan::NotSole);
    };
    let io = |step| move |source| MemoryError::GiveBack { step, source };
    let mut buf = Scratch::new(SCAN_BYTES).map_err(io("a buffer for /proc/self/pagemap"))?;
    let runs = private_runs_in(ram, &mut buf).map_err(io("reading /proc/self/pagemap"))?;
    drop(buf);
    let private_pages = crate::snapshot::diff::page_count(&runs);
    if private_pages > MAX_PRIVATE_PAGES {
        return Ok(Scan::TooMany { private_pages });
    }
    let mut held =
        Scratch::new((CHUNK_PAGES * PAGE) as usize).map_err(io("a buffer for guest RAM"))?;
    let mut equal = Vec::new();
    for_each_image_chunk(image, &runs, |piece, image_bytes| {
        let held = &mut held[..image_bytes.len()];
        ram.read_image_bytes(piece, held)?;
        for_each_equal_stretch(held, image_bytes, |start, count| {
            equal.push(PageRun {
                first: piece.first + start,
                count,
            });
            Ok::<(), MemoryError>(())
        })?;
        Ok(())
    })?;
    Ok(Scan::Candidates {
        private_pages,
        equal,
    })
}

/// Give back those of the pages of `runs` (found by [`scan`]) whose bytes equal the image's
/// at their place; returns how many. Nothing may write guest RAM meanwhile: the vCPUs and
/// devices are paused.
pub fn give_back_unchanged(ram: &GuestRam, runs: &[PageRun]) -> Result<u64> {
    let image = ram.sole_image().ok_or(MemoryError::GiveBack {
        step: "finding the snapshot's image",
        source: std::io::Error::other("guest RAM is no longer over a sole image"),
    })?;
    let mut given = 0;
    for_each_image_chunk(image, runs, |piece, image_bytes| {
        given += give_back_equal(ram, piece, image_bytes)?;
        Ok(())
    })?;
    Ok(given)
}

/// Call `f` with each piece of `runs`, at most [`CHUNK_PAGES`] long, and the image's bytes
/// there, read through one buffer mapped for the call.
fn for_each_image_chunk(
    image: &std::fs::File,
    runs: &[PageRun],
    mut f: impl FnMut(PageRun, &[u8]) -> Result<()>,
) -> Result<()> {
    let io = |step| move |source| MemoryError::GiveBack { step, source };
    let mut buf = Scratch::new((CHUNK_PAGES * PAGE) as usize)
        .map_err(io("a buffer for the image's pages"))?;
    for (piece, _) in crate::snapshot::diff::page_steps(runs, CHUNK_PAGES)
        .into_iter()
        .flatten()
    {
        let bytes = &mut buf[..piece.len() as usize];
        image
            .read_exact_at(bytes, piece.offset())
            .map_err(io("reading the snapshot's memory image"))?;
        f(piece, bytes)?;
    }
    Ok(())
}

/// Drop this process's copies of the pages of `piece` that equal `image` (the image's bytes
/// at its place), one call per stretch of equal pages; returns how many.
fn give_back_equal(ram: &GuestRam, piece: PageRun, image: &[u8]) -> Result<u64> {
    // SAFETY: the caller keeps the guest and the devices paused: nothing writes these pages
    // while they are read, and the slice is gone before the guest runs again.
    let held = unsafe { ram.run_bytes(piece)? };
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
            let offset = piece.offset() + start * PAGE;
            return Err(MemoryError::Advise {
                advice: "MADV_DONTNEED",
                guest_addr: ram.guest_addr_of(offset).unwrap_or(offset),
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

        let Scan::Candidates {
            private_pages,
            equal,
        } = scan(&ram).unwrap()
        else {
            panic!("a sole image")
        };
        assert_eq!(private_pages, 4);
        assert_eq!(
            equal,
            [PageRun {
                first: 10,
                count: 2
            }]
        );
        // Under the pause only those are compared again; a candidate changed since is kept.
        mem.write_obj(0x77u8, GuestAddress(11 * PAGE + 5)).unwrap();
        assert_eq!(give_back_unchanged(&ram, &equal).unwrap(), 1);
        assert_eq!(
            private(&ram),
            3,
            "the changed pages stay this process's own"
        );
        // The guest reads what it read before, from every page.
        let read = |at: u64| mem.read_obj::<u8>(GuestAddress(at)).unwrap();
        assert_eq!(read(10 * PAGE + 100), page_byte(10));
        assert_eq!(read(11 * PAGE + 5), 0x77);
        assert_eq!(read(11 * PAGE), page_byte(11));
        assert_eq!(read(20 * PAGE), 0xEE);
        assert_eq!(read(30 * PAGE + 4095), page_byte(30).wrapping_add(1));
        // A page given back is copied again by its next write, and the image is untouched.
        mem.write_obj(0x55u8, GuestAddress(10 * PAGE)).unwrap();
        assert_eq!(private(&ram), 4);
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
        assert_eq!(scan(&booted).unwrap(), Scan::NotSole);
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
        assert_eq!(scan(&layered).unwrap(), Scan::NotSole);
        assert_eq!(
            crate::snapshot::diff::page_count(&private_runs(&layered).unwrap()),
            1
        );
    }
}
