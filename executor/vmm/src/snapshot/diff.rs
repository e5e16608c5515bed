//! Diff snapshots: the pages a restored VM wrote since its restore, over the snapshot it was
//! restored from (its parent), which in turn may be a diff. A child's guest RAM is a private
//! mapping of its chain's files, so the pages it wrote are exactly the private (copy-on-write)
//! pages of that mapping: `/proc/self/pagemap` tells them apart from pages still backed by a
//! file. That also catches writes the VMM made itself (virtio rings, used by the devices),
//! which KVM's dirty log would not see.
//!
//! On disk a diff is `pages.bin` (the written pages, packed in guest order) and `pages.idx`
//! (their runs, bincode); restoring maps each run of each layer over the base image with
//! `MAP_FIXED | MAP_PRIVATE`, so a child of any depth maps its chain instead of copying it.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::memory::GuestRam;

pub const PAGES_FILE: &str = "pages.bin";
pub const INDEX_FILE: &str = "pages.idx";
pub const PAGE: u64 = 4096;
/// Deepest chain restored: deeper is more likely a loop or a mistake than a real lineage.
pub const MAX_CHAIN: usize = 64;

/// `count` consecutive pages of the memory image starting at page `first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageRun {
    pub first: u64,
    pub count: u64,
}

impl PageRun {
    pub fn offset(&self) -> u64 {
        self.first * PAGE
    }
    pub fn len(&self) -> u64 {
        self.count * PAGE
    }
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
}

/// One diff layer of a chain, ready to map: its page file and runs, packed in order.
#[derive(Debug)]
pub struct Overlay {
    pub file: File,
    pub runs: Vec<PageRun>,
}

const PM_PRESENT: u64 = 1 << 63;
const PM_SWAPPED: u64 = 1 << 62;
const PM_FILE_OR_SHARED: u64 = 1 << 61;

/// The runs of guest RAM pages this process holds privately: written (by the guest or by
/// us) since the RAM was mapped copy-on-write. Ranges never merge across the MMIO gap.
pub fn private_runs(ram: &GuestRam) -> std::io::Result<Vec<PageRun>> {
    private_runs_in(ram, &mut vec![0u8; 8 * 8192])
}

/// [`private_runs`], reading the page map through `buf` (a whole number of 8-byte entries,
/// at least one).
pub fn private_runs_in(ram: &GuestRam, buf: &mut [u8]) -> std::io::Result<Vec<PageRun>> {
    if buf.len() < 8 {
        return Err(std::io::Error::other("a page map buffer under one entry"));
    }
    let whole = buf.len() / 8 * 8;
    let buf = &mut buf[..whole];
    let pagemap = File::open("/proc/self/pagemap")?;
    let mut runs: Vec<PageRun> = Vec::new();
    for (range, host) in ram
        .host_ranges()
        .map_err(|e| std::io::Error::other(e.to_string()))?
    {
        let pages = range.size / PAGE;
        let first_image_page = range.file_offset / PAGE;
        let mut open: Option<PageRun> = None;
        let mut done = 0u64;
        while done < pages {
            let n = (pages - done).min((buf.len() / 8) as u64);
            let bytes = &mut buf[..(n * 8) as usize];
            pagemap.read_exact_at(bytes, (host / PAGE + done) * 8)?;
            for (i, e) in bytes.chunks_exact(8).enumerate() {
                let e = u64::from_le_bytes(e.try_into().unwrap());
                let private = e & (PM_PRESENT | PM_SWAPPED) != 0 && e & PM_FILE_OR_SHARED == 0;
                let page = first_image_page + done + i as u64;
                match (&mut open, private) {
                    (Some(r), true) => r.count += 1,
                    (None, true) => {
                        open = Some(PageRun {
                            first: page,
                            count: 1,
                        })
                    }
                    (Some(_), false) => runs.push(open.take().unwrap()),
                    (None, false) => {}
                }
            }
            done += n;
        }
        runs.extend(open);
    }
    Ok(runs)
}

/// `runs` cut into steps of at most `max` pages (at least 1), in order, each piece with its
/// offset in the runs packed one after another (as in a diff's page file).
pub fn page_steps(runs: &[PageRun], max: u64) -> Vec<Vec<(PageRun, u64)>> {
    let max = max.max(1);
    let mut steps = vec![Vec::new()];
    let (mut in_step, mut offset) = (0u64, 0u64);
    for r in runs {
        let mut left = *r;
        while left.count > 0 {
            if in_step == max {
                steps.push(Vec::new());
                in_step = 0;
            }
            let take = left.count.min(max - in_step);
            let piece = PageRun {
                first: left.first,
                count: take,
            };
            steps.last_mut().expect("never empty").push((piece, offset));
            offset += piece.len();
            in_step += take;
            left.first += take;
            left.count -= take;
        }
    }
    steps.retain(|s| !s.is_empty());
    steps
}

/// Call `f(first, count)` for each stretch of whole pages in which `held` equals `image` (two
/// views of the same pages), in order; returns how many pages differ.
pub fn for_each_equal_stretch<E>(
    held: &[u8],
    image: &[u8],
    mut f: impl FnMut(u64, u64) -> Result<(), E>,
) -> Result<u64, E> {
    let pages = (held.len().min(image.len()) as u64) / PAGE;
    let page = |i: u64| (i * PAGE) as usize..((i + 1) * PAGE) as usize;
    let mut differ = 0;
    let mut stretch: Option<u64> = None;
    for i in 0..=pages {
        let same = i < pages && held[page(i)] == image[page(i)];
        match (same, stretch) {
            (true, None) => stretch = Some(i),
            (false, Some(start)) => {
                f(start, i - start)?;
                stretch = None;
            }
            _ => {}
        }
        if i < pages && !same {
            differ += 1;
        }
    }
    Ok(differ)
}

/// Write the pages of `runs` from guest RAM to `path`, packed in order, and sync it. The VM
/// must be paused (nothing writes guest RAM meanwhile).
pub fn write_pages(ram: &GuestRam, runs: &[PageRun], path: &Path) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::with_capacity(1 << 20, File::create(path)?);
    for r in runs {
        out.write_all(ram_bytes(ram, r)?)?;
    }
    out.into_inner().map_err(|e| e.into_error())?.sync_all()
}

/// Write a diff's files into `dir`: `pages.bin` (the pages of `runs`) and `pages.idx` (the
/// runs), both synced. The guest must not write meanwhile (paused, or this is a fork's copy).
/// Returns the index as written.
pub fn write_diff_files(ram: &GuestRam, runs: &[PageRun], dir: &Path) -> std::io::Result<Vec<u8>> {
    write_pages(ram, runs, &dir.join(PAGES_FILE))?;
    let index = bincode::serialize(runs).map_err(std::io::Error::other)?;
    let mut f = File::create(dir.join(INDEX_FILE))?;
    f.write_all(&index)?;
    f.sync_all()?;
    Ok(index)
}

fn ram_bytes<'a>(ram: &'a GuestRam, r: &PageRun) -> std::io::Result<&'a [u8]> {
    // SAFETY: our callers' contract: nothing writes guest RAM while they read (the VM is
    // paused, or this is a fork's copy).
    unsafe { ram.run_bytes(*r) }.map_err(std::io::Error::other)
}

/// Write guest RAM as a complete image at `path` (sparse): the chain it was restored from
/// (base image, then each overlay), then the pages written since (`written`).
pub fn flatten(ram: &GuestRam, written: &[PageRun], path: &Path) -> std::io::Result<()> {
    let base = ram
        .file()
        .ok_or_else(|| std::io::Error::other("guest RAM has no backing file"))?;
    super::file::copy_sparse(base, ram.size(), path)?;
    let out = std::fs::OpenOptions::new().write(true).open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    ram.with_overlays(|overlays| -> std::io::Result<()> {
        for ov in overlays {
            let mut src = 0u64;
            for r in &ov.runs {
                let mut done = 0u64;
                while done < r.len() {
                    let n = (r.len() - done).min(buf.len() as u64) as usize;
                    ov.file.read_exact_at(&mut buf[..n], src + done)?;
                    out.write_all_at(&buf[..n], r.offset() + done)?;
                    done += n as u64;
                }
                src += r.len();
            }
        }
        Ok(())
    })?;
    for r in written {
        out.write_all_at(ram_bytes(ram, r)?, r.offset())?;
    }
    out.sync_all()
}

/// Why an index does not describe a usable diff of a `mem_size`-byte guest with `pages` pages.
pub fn check_runs(runs: &[PageRun], mem_size: u64, pages: u64) -> Result<(), String> {
    let mut next = 0u64;
    let mut total = 0u64;
    for r in runs {
        if r.count == 0 {
            return Err(format!("an empty run at page {}", r.first));
        }
        if r.first < next {
            return Err(format!(
                "run at page {} overlaps or is out of order",
                r.first
            ));
        }
        let end = r
            .first
            .checked_add(r.count)
            .filter(|e| e.checked_mul(PAGE).is_some_and(|b| b <= mem_size))
            .ok_or_else(|| format!("run at page {} ends past guest RAM", r.first))?;
        next = end;
        total += r.count;
    }
    if total != pages {
        return Err(format!("runs hold {total} pages, the header says {pages}"));
    }
    Ok(())
}

/// Pages in `runs`.
pub fn page_count(runs: &[PageRun]) -> u64 {
    runs.iter().map(|r| r.count).sum()
}

/// The pages in `a` or `b` (each sorted and non-overlapping) as sorted, non-overlapping runs.
/// Runs that only touch stay apart: they may lie on either side of the MMIO gap.
pub fn union(a: &[PageRun], b: &[PageRun]) -> Vec<PageRun> {
    let mut all: Vec<PageRun> = a.iter().chain(b).copied().collect();
    all.sort_by_key(|r| r.first);
    let mut out: Vec<PageRun> = Vec::with_capacity(all.len());
    for r in all.into_iter().filter(|r| r.count > 0) {
        match out.last_mut() {
            Some(last) if r.first < last.first + last.count => {
                let end = (last.first + last.count).max(r.first + r.count);
                last.count = end - last.first;
            }
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn equal_stretches_are_whole_runs_of_equal_pages() {
        use super::{for_each_equal_stretch, PAGE};
        let p = PAGE as usize;
        let image = vec![0u8; 6 * p];
        let mut held = image.clone();
        // Pages 2 and 5 differ (5 in its last byte only).
        held[2 * p + 7] = 1;
        held[6 * p - 1] = 1;
        let mut seen = Vec::new();
        let differ = for_each_equal_stretch(&held, &image, |first, count| {
            seen.push((first, count));
            Ok::<(), ()>(())
        });
        assert_eq!(differ, Ok(2));
        assert_eq!(seen, [(0, 2), (3, 2)]);
        // An error stops the walk and is returned.
        let stopped = for_each_equal_stretch(&held, &image, |_, _| Err("no"));
        assert_eq!(stopped, Err("no"));
    }

    #[test]
    fn union_merges_overlapping_and_touching_runs() {
        use super::{union, PageRun};
        let r = |first, count| PageRun { first, count };
        assert_eq!(
            union(&[r(0, 2), r(10, 2)], &[r(1, 3), r(11, 2), r(20, 1)]),
            vec![r(0, 4), r(10, 3), r(20, 1)]
        );
        assert_eq!(union(&[r(0, 2)], &[r(2, 1)]), vec![r(0, 2), r(2, 1)]);
        assert_eq!(union(&[], &[r(5, 1)]), vec![r(5, 1)]);
        assert_eq!(union(&[r(5, 1)], &[r(5, 1)]), vec![r(5, 1)]);
    }

    use super::*;

    #[test]
    fn index_checks_catch_overlaps_gaps_in_count_and_runs_past_ram() {
        let ok = [
            PageRun { first: 0, count: 2 },
            PageRun { first: 5, count: 1 },
        ];
        assert_eq!(check_runs(&ok, 16 * PAGE, 3), Ok(()));
        assert!(check_runs(&ok, 16 * PAGE, 4)
            .unwrap_err()
            .contains("header says 4"));
        let overlap = [
            PageRun { first: 0, count: 2 },
            PageRun { first: 1, count: 1 },
        ];
        assert!(check_runs(&overlap, 16 * PAGE, 3)
            .unwrap_err()
            .contains("overlaps"));
        let past = [PageRun {
            first: 15,
            count: 2,
        }];
        assert!(check_runs(&past, 16 * PAGE, 2)
            .unwrap_err()
            .contains("past guest RAM"));
        let huge = [PageRun {
            first: u64::MAX,
            count: 2,
        }];
        assert!(check_runs(&huge, 16 * PAGE, 2).is_err());
        let empty = [PageRun { first: 3, count: 0 }];
        assert!(check_runs(&empty, 16 * PAGE, 0)
            .unwrap_err()
            .contains("empty"));
    }
}
