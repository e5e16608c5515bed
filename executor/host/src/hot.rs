//! Hot snapshots: the memory image of a snapshot children are spawned from often, copied once
//! into shared memory in transparent huge pages and handed to each child's worker as a sealed
//! memfd, which it maps copy-on-write instead of `memory.img`.
//!
//! Why: a restored guest's first touch of each page is a nested page fault, and in a page
//! cache of 4 KiB pages it is one per 4 KiB. Over huge pages a read maps 2 MiB at once, for
//! the host and for KVM (in the lab: 43% fewer nested page faults per child,
//! docs/performance.md). A file on disk has no huge pages in its page cache, so the copy is
//! the way to them. It costs the image's data in memory once per host, hence a budget.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// The name a held image's memfd shows under in a process's maps (`/memfd:<name> (deleted)`).
pub const MEMFD_NAME: &str = "tine-hot-image";

/// Whether a path from a process's maps or smaps is a child's guest RAM: the snapshot's
/// memory file, or a held copy of it.
pub fn is_guest_ram(path: &str) -> bool {
    path.ends_with("/memory.img")
        || path
            .strip_prefix("/memfd:")
            .is_some_and(|name| name.starts_with(MEMFD_NAME))
}

/// Where the kernel says whether shared memory may use transparent huge pages.
pub const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// The selected word of a sysfs choice list such as `always within_size [advise] never`.
pub fn selected(list: &str) -> Option<&str> {
    list.split_whitespace()
        .find(|w| w.starts_with('[') && w.ends_with(']') && w.len() > 2)
        .map(|w| &w[1..w.len() - 1])
}

/// Whether memory advised with MADV_HUGEPAGE gets huge pages in shared memory here: at
/// `never` or `deny` a copy would be 4 KiB pages like the page cache, and gain nothing.
pub fn shmem_huge_pages() -> bool {
    std::fs::read_to_string(SHMEM_ENABLED)
        .ok()
        .as_deref()
        .and_then(selected)
        .is_some_and(|s| matches!(s, "always" | "within_size" | "advise" | "force"))
}

/// A snapshot's memory image held in memory.
#[derive(Debug)]
pub struct HotImage {
    /// Sealed: nothing can write, grow or shrink it any more.
    pub file: File,
    /// Memory it holds: the image's data, in whole huge pages where it got them (holes stay
    /// holes and cost nothing).
    pub bytes: u64,
}

impl HotImage {
    /// Copy `path` into a new memfd, through a shared mapping advised for huge pages, skipping
    /// its holes; then seal it.
    pub fn fill(path: &Path) -> std::io::Result<HotImage> {
        let src = File::open(path)?;
        let len = src.metadata()?.len();
        let file = memfd(MEMFD_NAME)?;
        file.set_len(len)?;
        if len > 0 {
            let map = SharedMap::new(&file, len as usize)?;
            // SAFETY: advice on our own mapping; it does not change its contents.
            unsafe { libc::madvise(map.ptr.cast(), map.len, libc::MADV_HUGEPAGE) };
            for (start, end) in tine_vmm::snapshot::file::data_extents(&src, len)? {
                // SAFETY: [start, end) lies within the mapping of `len` bytes (extents are
                // clamped to it), and nothing else references this fresh memory.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(
                        map.ptr.add(start as usize),
                        (end - start) as usize,
                    )
                };
                src.read_exact_at(dst, start)?;
            }
            drop(map);
        }
        // Children from here on map the copy: let the file's page cache go where nothing maps
        // it (advice only; on tmpfs the page cache is the file and stays).
        // SAFETY: advice on our own descriptor.
        unsafe { libc::posix_fadvise(src.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let seals =
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on our own descriptor; no writable mapping of it is left.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let bytes = file.metadata()?.blocks() * 512;
        Ok(HotImage { file, bytes })
    }
}

/// Which file an image was filled from: a snapshot replaced under the same name is another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl FileId {
    fn of(path: &Path) -> std::io::Result<(FileId, u64)> {
        let m = std::fs::metadata(path)?;
        let id = FileId {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
        };
        // What a copy would hold: the file's allocated blocks, at most its length.
        Ok((id, (m.blocks() * 512).min(m.len())))
    }
}

#[derive(Debug)]
enum Slot {
    /// A fill runs.
    Filling,
    Held {
        image: Arc<File>,
        bytes: u64,
        of: FileId,
    },
    /// Not held (over the budget, or the fill failed); not tried again for this file.
    Skipped(FileId),
}

/// The images a host holds, by the path of the `memory.img` each was filled from, within a
/// budget. Holding is automatic (after a snapshot's first spawn, in the background) only
/// where shared memory gets huge pages; [`hold`](Self::hold) holds one when asked.
pub struct HeldImages {
    budget_bytes: u64,
    automatic: bool,
    slots: Arc<Mutex<HashMap<PathBuf, Slot>>>,
}

impl HeldImages {
    /// Hold at most `budget_mib` of image data (0: none automatically).
    pub fn new(budget_mib: u64) -> HeldImages {
        let automatic = budget_mib > 0 && shmem_huge_pages();
        if budget_mib > 0 && !automatic {
            tracing::info!(
                "hot snapshot images off: {SHMEM_ENABLED} gives shared memory no huge pages \
                 (`tine doctor` says how to allow them)"
            );
        }
        HeldImages {
            budget_bytes: budget_mib << 20,
            automatic,
            slots: Arc::default(),
        }
    }

    fn slots(&self) -> MutexGuard<'_, HashMap<PathBuf, Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The image held for `memory`, if one is and it was filled from the file there now.
    pub fn get(&self, memory: &Path) -> Option<Arc<File>> {
        let mut slots = self.slots();
        let Some(Slot::Held { image, of, .. }) = slots.get(memory) else {
            return None;
        };
        if FileId::of(memory).ok().map(|(id, _)| id) == Some(*of) {
            return Some(image.clone());
        }
        // Replaced or gone: the copy is of something else.
        slots.remove(memory);
        None
    }

    /// Fill and hold an image of `memory` now, whatever the budget and the host's huge-page
    /// setting (a benchmark, a test, an operator's explicit choice). Returns the memory it holds.
    pub fn hold(&self, memory: &Path) -> std::io::Result<u64> {
        let (of, _) = FileId::of(memory)?;
        let hot = HotImage::fill(memory)?;
        let bytes = hot.bytes;
        self.slots().insert(
            memory.to_path_buf(),
            Slot::Held {
                image: Arc::new(hot.file),
                bytes,
                of,
            },
        );
        Ok(bytes)
    }

    /// Hold an image of `memory` from a background thread of lowest priority, if holding is
    /// automatic here, nothing was tried for this file yet, and it fits the budget.
    pub fn hold_in_background(&self, memory: &Path) {
        if !self.automatic {
            return;
        }
        let Ok((of, estimate)) = FileId::of(memory) else {
            return;
        };
        let mut slots = self.slots();
        // Copies of files deleted or replaced since (an evicted or deleted snapshot) go first.
        slots.retain(|path, slot| match slot {
            Slot::Held { of, .. } => FileId::of(path).is_ok_and(|(now, _)| now == *of),
            _ => true,
        });
        match slots.get(memory) {
            Some(Slot::Filling) => return,
            Some(Slot::Held { of: was, .. } | Slot::Skipped(was)) if *was == of => return,
            _ => {}
        }
        let held: u64 = slots
            .values()
            .map(|s| match s {
                Slot::Held { bytes, .. } => *bytes,
                _ => 0,
            })
            .sum();
        if held + estimate > self.budget_bytes {
            tracing::info!(
                memory = %memory.display(),
                mib = estimate >> 20,
                held_mib = held >> 20,
                budget_mib = self.budget_bytes >> 20,
                "not holding this snapshot's memory: over the hot-image budget"
            );
            slots.insert(memory.to_path_buf(), Slot::Skipped(of));
            return;
        }
        slots.insert(memory.to_path_buf(), Slot::Filling);
        drop(slots);
        let (slots, path) = (self.slots.clone(), memory.to_path_buf());
        let started = std::thread::Builder::new()
            .name("tine-hot-fill".into())
            .spawn(move || {
                crate::network::background_priority();
                let t = std::time::Instant::now();
                let slot = match HotImage::fill(&path) {
                    Ok(hot) => {
                        tracing::info!(
                            memory = %path.display(),
                            mib = hot.bytes >> 20,
                            took = ?t.elapsed(),
                            "holding this snapshot's memory in huge pages for its children"
                        );
                        Slot::Held {
                            bytes: hot.bytes,
                            image: Arc::new(hot.file),
                            of,
                        }
                    }
                    Err(e) => {
                        tracing::warn!(memory = %path.display(), "holding a snapshot's memory: {e}");
                        Slot::Skipped(of)
                    }
                };
                let mut slots = slots.lock().unwrap_or_else(|p| p.into_inner());
                // Forgotten meanwhile (the snapshot was deleted): drop the copy.
                if matches!(slots.get(&path), Some(Slot::Filling)) {
                    slots.insert(path, slot);
                }
            });
        if started.is_err() {
            self.slots().remove(memory);
        }
    }

    /// Let go of the image of `memory` (its snapshot is deleted); running children keep
    /// their mappings of it.
    pub fn forget(&self, memory: &Path) {
        self.slots().remove(memory);
    }

    /// The images held now and the memory each holds.
    pub fn held(&self) -> Vec<(PathBuf, u64)> {
        let mut v: Vec<(PathBuf, u64)> = self
            .slots()
            .iter()
            .filter_map(|(p, s)| match s {
                Slot::Held { bytes, .. } => Some((p.clone(), *bytes)),
                _ => None,
            })
            .collect();
        v.sort();
        v
    }
}

fn memfd(name: &str) -> std::io::Result<File> {
    let name = std::ffi::CString::new(name).expect("no NUL in the name");
    // SAFETY: a valid C string; the new descriptor is ours.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// A writable shared mapping of a file, unmapped when dropped.
struct SharedMap {
    ptr: *mut u8,
    len: usize,
}

impl SharedMap {
    fn new(f: &File, len: usize) -> std::io::Result<SharedMap> {
        // SAFETY: a fresh shared mapping of `len` bytes of our own file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(SharedMap { ptr: p.cast(), len })
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn the_selected_word_is_the_bracketed_one() {
        assert_eq!(
            selected("always within_size [advise] never deny force"),
            Some("advise")
        );
        assert_eq!(selected("[never] always"), Some("never"));
        assert_eq!(selected("always never"), None);
        assert_eq!(selected("[] x"), None);
    }

    #[test]
    fn a_held_image_is_a_sealed_copy_with_its_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory.img");
        let mut f = File::create(&path).unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(b"first page", 0).unwrap();
        f.write_all_at(&[0xab; 4096], 5 << 20).unwrap();
        f.flush().unwrap();
        drop(f);
        let hot = HotImage::fill(&path).unwrap();
        assert_eq!(hot.file.metadata().unwrap().len(), 8 << 20);
        let mut buf = [0u8; 10];
        hot.file.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"first page");
        let mut page = vec![0u8; 4096];
        hot.file.read_exact_at(&mut page, 5 << 20).unwrap();
        assert!(page.iter().all(|&b| b == 0xab));
        hot.file.read_exact_at(&mut page, 3 << 20).unwrap();
        assert!(page.iter().all(|&b| b == 0), "a hole reads as zeros");
        // Far less than the whole 8 MiB was copied (the file system keeps holes).
        assert!(hot.bytes > 0 && hot.bytes < 8 << 20, "{}", hot.bytes);
        // Sealed: no write, no resize.
        assert!(hot.file.write_at(b"x", 0).is_err());
        assert!(hot.file.set_len(1 << 20).is_err());
        // SAFETY: fcntl query on our own descriptor.
        let seals = unsafe { libc::fcntl(hot.file.as_raw_fd(), libc::F_GET_SEALS) };
        assert_ne!(seals & libc::F_SEAL_WRITE, 0);
    }

    #[test]
    fn a_held_image_is_given_out_only_while_its_file_is_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memory.img");
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let held = HeldImages::new(0);
        assert!(held.get(&path).is_none());
        assert!(held.hold(&path).unwrap() >= 1 << 20);
        let image = held.get(&path).expect("held");
        let mut b = [0u8; 1];
        image.read_exact_at(&mut b, 4096).unwrap();
        assert_eq!(b[0], 7);
        assert_eq!(held.held().len(), 1);
        assert_eq!(held.held()[0].0, path);
        // Replaced under the same name: not the file it was filled from.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, vec![9u8; 2 << 20]).unwrap();
        assert!(held.get(&path).is_none());
        assert!(held.held().is_empty());
        held.hold(&path).unwrap();
        held.forget(&path);
        assert!(held.get(&path).is_none());
        // Budget 0: never held in the background.
        held.hold_in_background(&path);
        assert!(held.held().is_empty());
    }

    #[test]
    fn a_missing_image_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(HotImage::fill(&dir.path().join("nope")).is_err());
    }
}
