//! Guest RAM backed by a memfd (or any file), so the same bytes can later be saved as a
//! snapshot image and mapped MAP_PRIVATE by forked children; or anonymous memory whose pages
//! another party supplies on first touch (userfaultfd: a child restored before its image is
//! on this host).

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use vm_memory::{FileOffset, GuestAddress, GuestMemoryMmap, GuestRegionMmap, MmapRegion};

use crate::error::{ConfigError, MemoryError, Result};
use crate::layout::{MMIO_GAP_END, MMIO_GAP_START};
use crate::snapshot::diff::{Overlay, PageRun, PAGE};

/// Smallest guest we accept: Linux with an initramfs needs more than this anyway.
pub const MIN_MEM_MIB: u64 = 32;
/// Largest guest we accept; beyond this a typo is more likely than a real request.
pub const MAX_MEM_MIB: u64 = 1 << 20;

/// One contiguous guest-physical range and where it lives in the backing file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamRange {
    pub guest_addr: u64,
    pub size: u64,
    pub file_offset: u64,
}

/// How the backing file is mapped into this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sharing {
    /// Writes go to the file (a booting parent whose memory becomes the snapshot image).
    Shared,
    /// Copy-on-write: the file is never modified (a forked child).
    Private,
}

/// The snapshot copy-on-write RAM was restored from: what a diff of it is taken over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Origin {
    pub dir: PathBuf,
    /// Its state checksum: a diff names its parent by directory and by this.
    pub state_sha256: String,
}

/// Guest RAM: its backing plus its mapping into this process.
pub struct GuestRam {
    /// None: anonymous private memory (filled through userfaultfd by whoever holds it).
    file: Option<Arc<File>>,
    ranges: Vec<RamRange>,
    memory: GuestMemoryMmap,
    size: u64,
    /// Changes only when a running VM is rebased onto its own branch.
    layers: Mutex<Layers>,
    /// Open to page merging ([`advise_mergeable`](Self::advise_mergeable)): mappings made
    /// later by a rebase are advised too.
    mergeable: std::sync::atomic::AtomicBool,
}

/// What guest RAM is mapped from, over `file`, and what a diff of it is taken over.
struct Layers {
    /// Diff layers mapped over `file`, oldest first.
    overlays: Vec<Overlay>,
    /// Snapshots a diff of this RAM can be taken over, oldest first: the one it was restored
    /// from, then each branch it was rebased onto.
    bases: Vec<Base>,
    /// A rebase mapped pages from a layer (set by its first step, before the layer is
    /// recorded in `overlays` at its end): the image no longer backs every page.
    rebased: bool,
}

struct Base {
    origin: Origin,
    /// How many of `overlays` that snapshot's chain maps.
    layers: usize,
}

/// Every page `overlays` map, as sorted runs.
fn pages_of(overlays: &[Overlay]) -> Vec<PageRun> {
    overlays.iter().fold(Vec::new(), |acc, ov| {
        crate::snapshot::diff::union(&acc, &ov.runs)
    })
}

/// A diff layer's page file mapped read-only, populated when made (before a pause), to
/// compare guest RAM with.
pub struct LayerView {
    ptr: *mut libc::c_void,
    len: usize,
}

impl LayerView {
    pub fn open(layer: &Overlay) -> Result<Self> {
        let len = layer.runs.iter().map(PageRun::len).sum::<u64>() as usize;
        if len == 0 {
            return Ok(Self {
                ptr: std::ptr::null_mut(),
                len,
            });
        }
        // SAFETY: a fresh read-only shared mapping of the (size-checked) page file, unmapped
        // on drop; nothing else refers to it.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                layer.file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(MemoryError::Overlay {
                offset: 0,
                len: len as u64,
                source: std::io::Error::last_os_error(),
            }
            .into());
        }
        Ok(Self { ptr, len })
    }

    fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: `ptr` maps `len` readable bytes for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u8, self.len) }
    }
}

impl Drop for LayerView {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: unmapping exactly the mapping made in `open`.
            unsafe { libc::munmap(self.ptr, self.len) };
        }
    }
}

/// What a rebase ([`GuestRam::rebase_step`]) did with a layer's pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rebased {
    /// Now mapped from the layer's page file (and shared with its children).
    pub pages_mapped: u64,
    /// Changed since the layer was written: still private, part of the next diff.
    pub pages_kept: u64,
}

impl GuestRam {
    /// Split `size` bytes of RAM around the 32-bit MMIO gap.
    pub fn ranges_for(size: u64) -> Vec<RamRange> {
        if size <= MMIO_GAP_START {
            return vec![RamRange {
                guest_addr: 0,
                size,
                file_offset: 0,
            }];
        }
        vec![
            RamRange {
                guest_addr: 0,
                size: MMIO_GAP_START,
                file_offset: 0,
            },
            RamRange {
                guest_addr: MMIO_GAP_END,
                size: size - MMIO_GAP_START,
                file_offset: MMIO_GAP_START,
            },
        ]
    }

    /// Fresh, zero-filled RAM in an anonymous memfd.
    pub fn new_memfd(mem_mib: u64) -> Result<Self> {
        validate_mem_mib(mem_mib)?;
        let size = mem_mib << 20;
        // SAFETY: the name is a valid NUL-terminated string; the returned fd is checked.
        let fd = unsafe { libc::memfd_create(c"tine-guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(MemoryError::Memfd {
                source: std::io::Error::last_os_error(),
            }
            .into());
        }
        // SAFETY: fd is a freshly created descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(size).map_err(|source| MemoryError::Resize {
            mib: mem_mib,
            source,
        })?;
        Self::map(Some(file), size, Sharing::Shared)
    }

    /// Map an existing memory image (a snapshot) of exactly `size` bytes.
    pub fn from_file(file: File, size: u64, sharing: Sharing) -> Result<Self> {
        let len = file
            .metadata()
            .map_err(|source| MemoryError::StatImage { source })?
            .len();
        if len != size {
            return Err(MemoryError::ImageSize {
                expected: size,
                actual: len,
            }
            .into());
        }
        Self::map(Some(file), size, sharing)
    }

    /// Anonymous, private, zero-on-demand RAM of `size` bytes (whole pages): nothing is
    /// populated until touched, so a userfaultfd registered on [`ranges`](Self::ranges) sees
    /// every first touch. `size` comes from a checked snapshot header.
    pub fn new_anonymous(size: u64) -> Result<Self> {
        if size == 0 || !size.is_multiple_of(4096) {
            return Err(MemoryError::AnonymousSize { size }.into());
        }
        Self::map(None, size, Sharing::Private)
    }

    fn map(file: Option<File>, size: u64, sharing: Sharing) -> Result<Self> {
        let file = file.map(Arc::new);
        let ranges = Self::ranges_for(size);
        let flags = libc::MAP_NORESERVE
            | match sharing {
                Sharing::Shared => libc::MAP_SHARED,
                Sharing::Private => libc::MAP_PRIVATE,
            }
            | if file.is_none() {
                libc::MAP_ANONYMOUS
            } else {
                0
            };
        let mut regions = Vec::with_capacity(ranges.len());
        for r in &ranges {
            let mapping = MmapRegion::build(
                file.as_ref()
                    .map(|f| FileOffset::from_arc(f.clone(), r.file_offset)),
                r.size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
            )
            .map_err(|source| MemoryError::Map {
                guest_addr: r.guest_addr,
                size: r.size,
                source,
            })?;
            if file.is_some() && sharing == Sharing::Shared {
                advise_huge(&mapping, r.size);
            }
            let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_addr)).ok_or(
                MemoryError::RegionOverflow {
                    guest_addr: r.guest_addr,
                    size: r.size,
                },
            )?;
            regions.push(region);
        }
        let memory = GuestMemoryMmap::from_regions(regions)
            .map_err(|source| MemoryError::Layout { source })?;
        Ok(Self {
            file,
            ranges,
            memory,
            size,
            layers: Mutex::new(Layers {
                overlays: Vec::new(),
                bases: Vec::new(),
                rebased: false,
            }),
            mergeable: std::sync::atomic::AtomicBool::new(false),
        })
    }

    fn layers(&self) -> MutexGuard<'_, Layers> {
        self.layers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Map image pages `run` from `file` at `file_offset`, copy-on-write, over guest RAM.
    fn map_from(&self, file: &File, run: PageRun, file_offset: u64) -> Result<()> {
        let addr =
            self.image_host_ptr(run.offset(), run.len())
                .ok_or(MemoryError::OverlayOutside {
                    offset: run.offset(),
                    len: run.len(),
                })?;
        // SAFETY: the run lies inside one of our own RAM mappings (checked above), so
        // MAP_FIXED only replaces pages of that mapping, never foreign memory.
        let p = unsafe {
            libc::mmap(
                addr.cast(),
                run.len() as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_FIXED | libc::MAP_NORESERVE,
                file.as_raw_fd(),
                file_offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(MemoryError::Overlay {
                offset: run.offset(),
                len: run.len(),
                source: std::io::Error::last_os_error(),
            }
            .into());
        }
        Ok(())
    }

    /// Copy-on-write RAM of a snapshot chain: `base` (the root's image) mapped private, then
    /// each overlay's runs (oldest first) mapped over it from the overlay's page file. No page
    /// is copied: every layer's pages stay shared with all children that map them.
    pub fn from_chain(
        base: File,
        size: u64,
        overlays: Vec<Overlay>,
        origin: Origin,
    ) -> Result<Self> {
        let ram = Self::from_file(base, size, Sharing::Private)?;
        for ov in &overlays {
            let mut file_offset = 0u64;
            for r in &ov.runs {
                ram.map_from(&ov.file, *r, file_offset)?;
                file_offset += r.len();
            }
        }
        let layers = overlays.len();
        *ram.layers() = Layers {
            overlays,
            bases: vec![Base { origin, layers }],
            rebased: false,
        };
        Ok(ram)
    }

    /// Calls `f` with the diff layers mapped over the base image, oldest first.
    pub fn with_overlays<R>(&self, f: impl FnOnce(&[Overlay]) -> R) -> R {
        f(&self.layers().overlays)
    }

    /// How many diff layers are mapped over the base image.
    pub fn depth(&self) -> usize {
        self.layers().overlays.len()
    }

    /// The snapshot this RAM is a diff over (None: fresh or page-by-page RAM).
    pub fn origin(&self) -> Option<Origin> {
        self.layers().bases.last().map(|b| b.origin.clone())
    }

    /// The snapshot this RAM was restored from is now reached at `dir` (a VMM that entered
    /// its confined view after mapping it sees it there): later diffs name it by that path.
    /// Only a fresh restore's (no branch yet) is moved; the others are left as they are.
    pub fn origin_seen_at(&self, dir: &Path) {
        let mut l = self.layers();
        if let [base] = l.bases.as_mut_slice() {
            base.origin.dir = dir.to_path_buf();
        }
    }

    /// The newest snapshot a diff of this RAM can be taken over, of those `usable` accepts
    /// (still there, unchanged), with the runs of the layers mapped since it: pages a diff
    /// over it must hold besides the private ones. None: no usable one.
    pub fn diff_base(&self, usable: impl Fn(&Origin) -> bool) -> Option<(Origin, Vec<PageRun>)> {
        let l = self.layers();
        let base = l.bases.iter().rev().find(|b| usable(&b.origin))?;
        Some((base.origin.clone(), pages_of(&l.overlays[base.layers..])))
    }

    /// The pages mapped from branches this RAM was rebased onto since its restore: written
    /// since the restore, though no longer private.
    pub fn since_restore(&self) -> Vec<PageRun> {
        let l = self.layers();
        let first = l.bases.first().map_or(l.overlays.len(), |b| b.layers);
        pages_of(&l.overlays[first..])
    }

    /// For a diff over the newest base `is_parent` accepts holding `runs`: whether it holds
    /// every page mapped since that base (only then can this RAM be rebased onto it). None:
    /// no base is its parent.
    pub fn holds_all_since(
        &self,
        is_parent: impl Fn(&Origin) -> bool,
        runs: &[PageRun],
    ) -> Option<bool> {
        let l = self.layers();
        let base = l.bases.iter().rev().find(|b| is_parent(&b.origin))?;
        let held = crate::snapshot::diff::page_count(runs);
        Some(l.overlays[base.layers..].iter().all(|ov| {
            crate::snapshot::diff::page_count(&crate::snapshot::diff::union(runs, &ov.runs)) == held
        }))
    }

    /// Rebasing onto `layer` (a diff written from this RAM over one of its bases): map from
    /// its page file those pages of `pieces` (runs of it, each with its offset in the file)
    /// that still hold what the layer holds, so a later diff need not hold them. Pages written
    /// since stay private. Nothing may write guest RAM meanwhile (the guest is paused); a
    /// rebase is one or more such steps, then [`finish_rebase`](Self::finish_rebase).
    pub fn rebase_step(
        &self,
        layer: &Overlay,
        view: &LayerView,
        pieces: &[(PageRun, u64)],
        done: &mut Rebased,
    ) -> Result<()> {
        self.layers().rebased = true;
        self.map_unchanged(layer, view.bytes(), pieces, done)
    }

    /// Record `layer` as mapped (some of its pages may be, whatever happened) and, when every
    /// step succeeded, its snapshot `origin` as the base later diffs are taken over.
    pub fn finish_rebase(&self, layer: Overlay, origin: Origin, complete: bool) {
        let mut l = self.layers();
        // Even a mapping that failed halfway left pages mapped from the layer: a diff over an
        // older base must hold them, so the layer is recorded either way.
        l.overlays.push(layer);
        if complete {
            let layers = l.overlays.len();
            l.bases.push(Base { origin, layers });
        }
        drop(l);
        // The layer's mappings replaced advised ones; pages the guest writes there later
        // are as mergeable as before.
        if self.is_mergeable() {
            if let Err(e) = self.advise_mapped(libc::MADV_MERGEABLE, "MADV_MERGEABLE") {
                tracing::warn!("guest RAM after a rebase: {e}");
            }
        }
    }

    /// Map from `layer`'s file the pages of `pieces` whose RAM equals `file_bytes` (the page
    /// file's contents), one mapping per stretch of equal pages.
    fn map_unchanged(
        &self,
        layer: &Overlay,
        file_bytes: &[u8],
        pieces: &[(PageRun, u64)],
        done: &mut Rebased,
    ) -> Result<()> {
        for &(r, file_offset) in pieces {
            // SAFETY: the guest is paused (see rebase_step) until the slice is dropped.
            let ram = unsafe { self.run_bytes(r)? };
            let f = file_offset as usize;
            let image = &file_bytes[f..f + r.len() as usize];
            done.pages_kept +=
                crate::snapshot::diff::for_each_equal_stretch(ram, image, |start, count| {
                    let run = PageRun {
                        first: r.first + start,
                        count,
                    };
                    self.map_from(&layer.file, run, file_offset + start * PAGE)?;
                    done.pages_mapped += count;
                    Ok::<(), crate::error::Error>(())
                })?;
        }
        Ok(())
    }

    /// The bytes of image pages `r`, which must lie inside one RAM range.
    ///
    /// # Safety
    /// Nothing may write those pages while the slice lives: the guest and the devices are
    /// paused until it is dropped.
    pub(crate) unsafe fn run_bytes(&self, r: PageRun) -> Result<&[u8]> {
        let ptr = self
            .image_host_ptr(r.offset(), r.len())
            .ok_or(MemoryError::OverlayOutside {
                offset: r.offset(),
                len: r.len(),
            })?;
        // SAFETY: inside one of our RAM mappings (checked above), which live as long as self;
        // the caller keeps writers away.
        Ok(unsafe { std::slice::from_raw_parts(ptr as *const u8, r.len() as usize) })
    }

    /// Copy image pages `r` (inside one RAM range) into `buf` (as long as `r`) while the guest
    /// may be writing them, as the guest's memory is always read (volatile): a page that
    /// changes meanwhile may read as torn, never as anything else.
    pub fn read_image_bytes(&self, r: PageRun, buf: &mut [u8]) -> Result<()> {
        use vm_memory::Bytes;
        let outside = MemoryError::OverlayOutside {
            offset: r.offset(),
            len: r.len(),
        };
        let at = self
            .guest_addr_of(r.offset())
            .filter(|_| self.image_host_ptr(r.offset(), r.len()).is_some())
            .ok_or(outside)?;
        self.memory
            .read_slice(buf, GuestAddress(at))
            .map_err(|source| MemoryError::HostAddress {
                guest_addr: at,
                source,
            })?;
        Ok(())
    }

    /// The guest-physical address of image byte `offset`, if it is guest RAM.
    pub fn guest_addr_of(&self, offset: u64) -> Option<u64> {
        self.ranges
            .iter()
            .find(|r| offset >= r.file_offset && offset - r.file_offset < r.size)
            .map(|r| r.guest_addr + (offset - r.file_offset))
    }

    /// Host address of image bytes `[offset, offset + len)` if they lie inside one RAM range.
    pub fn image_host_ptr(&self, offset: u64, len: u64) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        let r = self
            .ranges
            .iter()
            .find(|r| offset >= r.file_offset && end <= r.file_offset + r.size)?;
        let base = self.host_address(r).ok()?;
        Some((base + (offset - r.file_offset)) as *mut u8)
    }

    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.memory
    }

    pub fn ranges(&self) -> &[RamRange] {
        &self.ranges
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The image that backs every page of this RAM not held privately: restored (copy-on-write)
    /// from a snapshot's complete image, with no diff layer mapped over it. None otherwise.
    pub fn sole_image(&self) -> Option<&File> {
        let l = self.layers();
        let sole = !l.bases.is_empty() && l.overlays.is_empty() && !l.rebased;
        drop(l);
        sole.then_some(self.file.as_deref()).flatten()
    }

    /// The backing file; None for anonymous RAM.
    pub fn file(&self) -> Option<&File> {
        self.file.as_deref()
    }

    /// Host address and length of every RAM range, in [`ranges`](Self::ranges) order.
    pub fn host_ranges(&self) -> Result<Vec<(RamRange, u64)>> {
        self.ranges
            .iter()
            .map(|r| Ok((*r, self.host_address(r)?)))
            .collect()
    }

    /// The highest guest-physical address below the MMIO gap that is RAM (exclusive).
    pub fn low_ram_end(&self) -> u64 {
        self.ranges[0].size
    }

    /// Let the host's KSM daemon merge this RAM's pages with identical pages of other
    /// mergeable memory (`MADV_MERGEABLE`), such as the same page written alike by sibling
    /// children. KSM merges anonymous pages only: over a memory image, the pages the guest
    /// wrote (the rest still map the image); in anonymous RAM (a lazy restore), every page
    /// present, the image's included. A merged page is read-only to the host: the guest's
    /// next write to it takes a fault and a fresh copy.
    pub fn advise_mergeable(&self) -> Result<()> {
        self.advise_mapped(libc::MADV_MERGEABLE, "MADV_MERGEABLE")?;
        // Only once it worked: a rebase then advises its new mappings too.
        self.mergeable
            .store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// Whether [`advise_mergeable`](Self::advise_mergeable) was asked for.
    pub fn is_mergeable(&self) -> bool {
        self.mergeable.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// `advice` over every RAM region, overlays included (advice applies to each mapping
    /// in the range).
    fn advise_mapped(&self, advice: libc::c_int, name: &'static str) -> Result<()> {
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        for region in self.memory.iter() {
            // SAFETY: advice over our own mapping of exactly this length; MADV_MERGEABLE
            // never changes what the memory holds.
            let rc =
                unsafe { libc::madvise(region.as_ptr().cast(), region.len() as usize, advice) };
            if rc != 0 {
                return Err(MemoryError::Advise {
                    advice: name,
                    guest_addr: region.start_addr().0,
                    source: std::io::Error::last_os_error(),
                }
                .into());
            }
        }
        Ok(())
    }

    /// Ask for transparent huge pages on every RAM mapping: a private mapping of a file held
    /// in huge pages then maps 2 MiB on a read fault (a write still copies 4 KiB).
    pub fn advise_huge_pages(&self) {
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        for region in self.memory.iter() {
            advise_huge(region, region.len());
        }
    }

    /// Host address of a guest range, for KVM memory-slot registration.
    pub fn host_address(&self, range: &RamRange) -> Result<u64> {
        use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};
        let region = self
            .memory
            .find_region(GuestAddress(range.guest_addr))
            .ok_or(MemoryError::NotMapped {
                guest_addr: range.guest_addr,
            })?;
        let ptr = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .map_err(|source| MemoryError::HostAddress {
                guest_addr: range.guest_addr,
                source,
            })?;
        Ok(ptr as u64)
    }
}

/// Ask for transparent huge pages on a booting VM's RAM (a shared memfd): a guest that
/// touches its memory for the first time, as every cold boot does, then takes one nested page
/// fault per 2 MiB instead of one per 4 KiB. The host decides: shmem huge pages need
/// `/sys/kernel/mm/transparent_hugepage/shmem_enabled` at `advise` (or `within_size`,
/// `always`); at the default `never` this changes nothing, so a refusal is only logged.
fn advise_huge(mapping: &MmapRegion, size: u64) {
    // SAFETY: advice on our own fresh mapping of `size` bytes; it never changes its contents.
    let rc = unsafe { libc::madvise(mapping.as_ptr().cast(), size as usize, libc::MADV_HUGEPAGE) };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "MADV_HUGEPAGE refused for guest RAM");
    } else {
        tracing::debug!(
            addr = mapping.as_ptr() as usize,
            aligned_2m = (mapping.as_ptr() as usize).is_multiple_of(2 << 20),
            "guest RAM advised for huge pages"
        );
    }
}

pub fn validate_mem_mib(mem_mib: u64) -> Result<()> {
    if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&mem_mib) {
        return Err(ConfigError::MemorySize {
            mib: mem_mib,
            min: MIN_MEM_MIB,
            max: MAX_MEM_MIB,
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use vm_memory::Bytes;

    #[test]
    fn small_guest_is_one_range() {
        assert_eq!(
            GuestRam::ranges_for(256 << 20),
            vec![RamRange {
                guest_addr: 0,
                size: 256 << 20,
                file_offset: 0
            }]
        );
    }

    #[test]
    fn large_guest_skips_the_mmio_gap() {
        let r = GuestRam::ranges_for(4 << 30);
        assert_eq!(r.len(), 2);
        assert_eq!(r[0].size, MMIO_GAP_START);
        assert_eq!(r[1].guest_addr, 1 << 32);
        assert_eq!(r[1].size, (4 << 30) - MMIO_GAP_START);
        assert_eq!(r[1].file_offset, MMIO_GAP_START);
    }

    #[test]
    fn memfd_ram_is_shared_with_the_file() {
        let ram = GuestRam::new_memfd(64).unwrap();
        ram.memory()
            .write_slice(b"tine", GuestAddress(0x1234))
            .unwrap();
        let mut buf = [0u8; 4];
        std::os::unix::fs::FileExt::read_exact_at(ram.file().unwrap(), &mut buf, 0x1234).unwrap();
        assert_eq!(&buf, b"tine");
    }

    /// The VmFlags of our own mapping that starts at `addr`.
    fn vm_flags(addr: usize) -> Vec<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let head = format!("{addr:x}-");
        let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&head));
        assert!(lines.next().is_some(), "no mapping at {addr:#x}");
        let flags = lines
            .find_map(|l| l.strip_prefix("VmFlags:"))
            .expect("VmFlags line");
        flags.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn private_ram_advised_mergeable_is_marked_for_ksm() {
        use vm_memory::GuestMemoryBackend;
        if !std::path::Path::new("/sys/kernel/mm/ksm").exists() {
            println!("SKIPPED: this kernel has no KSM (MADV_MERGEABLE fails with EINVAL)");
            return;
        }
        let parent = GuestRam::new_memfd(64).unwrap();
        let image = parent.file().unwrap().try_clone().unwrap();
        let child = GuestRam::from_file(image, 64 << 20, Sharing::Private).unwrap();
        let addr = child.memory().iter().next().unwrap().as_ptr() as usize;
        assert!(!vm_flags(addr).iter().any(|f| f == "mg"));
        assert!(!child.is_mergeable());
        child.advise_mergeable().unwrap();
        assert!(child.is_mergeable());
        assert!(
            vm_flags(addr).iter().any(|f| f == "mg"),
            "{:?}",
            vm_flags(addr)
        );
        // A guest write still lands in the child alone.
        child
            .memory()
            .write_slice(b"merge", GuestAddress(0x3000))
            .unwrap();
        let mut buf = [0u8; 5];
        parent
            .memory()
            .read_slice(&mut buf, GuestAddress(0x3000))
            .unwrap();
        assert_eq!(buf, [0; 5]);
    }

    #[test]
    fn private_mapping_never_writes_the_image() {
        let parent = GuestRam::new_memfd(64).unwrap();
        parent
            .memory()
            .write_slice(b"parent", GuestAddress(0x2000))
            .unwrap();
        let image = parent.file().unwrap().try_clone().unwrap();
        let child = GuestRam::from_file(image, 64 << 20, Sharing::Private).unwrap();
        child
            .memory()
            .write_slice(b"child!", GuestAddress(0x2000))
            .unwrap();
        let mut buf = [0u8; 6];
        parent
            .memory()
            .read_slice(&mut buf, GuestAddress(0x2000))
            .unwrap();
        assert_eq!(&buf, b"parent");
    }

    #[test]
    fn rejects_silly_sizes() {
        let err = GuestRam::new_memfd(1).err().unwrap();
        assert!(
            matches!(
                err,
                Error::Config(ConfigError::MemorySize {
                    mib: 1,
                    min: MIN_MEM_MIB,
                    max: MAX_MEM_MIB
                })
            ),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains(&format!("{MIN_MEM_MIB}..={MAX_MEM_MIB} MiB")),
            "{err}"
        );
        assert!(GuestRam::new_memfd(MAX_MEM_MIB + 1).is_err());
    }

    #[test]
    fn rejects_truncated_image() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(1 << 20).unwrap();
        let err = GuestRam::from_file(f, 64 << 20, Sharing::Private)
            .err()
            .unwrap();
        assert!(
            matches!(
                err,
                Error::Memory(MemoryError::ImageSize {
                    expected: 0x400_0000,
                    actual: 0x10_0000
                })
            ),
            "{err:?}"
        );
        assert!(err.to_string().contains("truncated"), "{err}");
    }
}
