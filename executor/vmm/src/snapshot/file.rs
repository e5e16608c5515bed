//! Reading and writing snapshot directories: atomic (temp dir, fsync, rename), checksummed, and
//! validated against the host before anything is restored.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::diff::{self, Overlay, PageRun, INDEX_FILE, MAX_CHAIN, PAGES_FILE};
use super::host_id::HostIdentity;
use super::MachineState;
use crate::devices::vmgenid::Driver;
use crate::error::{RestoreError, Result, SnapshotError};
use crate::memory::{GuestRam, Origin};

pub const FORMAT_VERSION: u32 = 1;
pub const HEADER_FILE: &str = "snapshot.json";
pub const STATE_FILE: &str = "state.bin";
pub const MEMORY_FILE: &str = "memory.img";

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SnapshotHeader {
    pub format: String,
    pub version: u32,
    pub created_unix_ms: u64,
    pub host: HostIdentity,
    pub vcpus: u32,
    pub mem_size: u64,
    pub state_len: u64,
    pub state_sha256: String,
    /// Set for a diff: the snapshot its pages apply over. Absent: `memory.img` is complete.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diff: Option<DiffInfo>,
    /// The guest has a network interface (a virtio-net device): its children can be given a
    /// network. Absent in snapshots from before network devices.
    #[serde(default)]
    pub network: bool,
    /// The guest's tables announce a VM generation ID at `layout::VMGENID_ADDR` (and its event
    /// device at `layout::GED_IRQ`): each restore writes a new one, and raises the interrupt as
    /// `vmgenid_driver` says. Absent in snapshots of guests booted before it, which are
    /// restored without.
    #[serde(default)]
    pub vmgenid: bool,
    /// Whether the guest's generation-ID driver has bound (devices::vmgenid::Driver): a
    /// restore raises the interrupt only when it has. Absent for guests booted before the VMM
    /// watched, whose restores always raise it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vmgenid_driver: Option<bool>,
}

/// What a diff snapshot applies over, and what it holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiffInfo {
    /// The parent: a sibling directory's name.
    pub parent: String,
    /// The parent's state checksum when the diff was taken: a parent replaced since is refused.
    pub parent_state_sha256: String,
    /// Pages in `pages.bin`.
    pub pages: u64,
    pub index_sha256: String,
}

/// What a snapshot holds of guest memory, and where it comes from.
pub enum MemoryOut<'a> {
    /// Complete, copied (sparse) from a file that holds guest RAM byte for byte.
    Image(&'a File),
    /// Complete, flattened from copy-on-write RAM: its chain, then the pages written since.
    Flatten {
        ram: &'a GuestRam,
        written: &'a [PageRun],
    },
    /// Only the pages written since the RAM was restored from `parent`.
    Diff {
        ram: &'a GuestRam,
        written: &'a [PageRun],
        parent: &'a Origin,
    },
}

const FORMAT_NAME: &str = "tine-vm-snapshot";

/// Context for an I/O failure while writing `path`.
fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> SnapshotError + '_ {
    move |source| SnapshotError::Write {
        path: path.to_path_buf(),
        source,
    }
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(write_err(dir))?;
    Ok(())
}

/// Copy guest RAM from `src` to a new file at `dst`, leaving holes where `src` has none of data.
pub fn write_memory(src: &File, len: u64, dst: &Path) -> Result<()> {
    copy_sparse(src, len, dst).map_err(write_err(dst))?;
    Ok(())
}

pub(crate) fn copy_sparse(src: &File, len: u64, dst: &Path) -> std::io::Result<()> {
    let out = File::create(dst)?;
    out.set_len(len)?;
    for (start, end) in data_extents(src, len)? {
        copy_range(src, &out, start, end)?;
    }
    out.sync_all()?;
    Ok(())
}

/// The ranges `[start, end)` of `f`'s first `len` bytes that hold data, as SEEK_DATA and
/// SEEK_HOLE report them (a file system without holes reports it all as data).
pub fn data_extents(f: &File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    use std::os::fd::AsRawFd;
    let fd = f.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: plain lseek on a valid fd.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only holes remain
            }
            return Err(e);
        }
        if data as u64 >= len {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 {
            len
        } else {
            (hole as u64).min(len)
        };
        if end <= data as u64 {
            break;
        }
        out.push((data as u64, end));
        pos = end as i64;
    }
    Ok(out)
}

/// Copy `[start, end)` between files: in the kernel when it can (same filesystem), else
/// through a buffer that skips all-zero pages so the copy stays sparse.
fn copy_range(src: &File, dst: &File, start: u64, end: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let (sfd, dfd) = (src.as_raw_fd(), dst.as_raw_fd());
    let mut off_in = start as i64;
    let mut off_out = start as i64;
    while (off_in as u64) < end {
        // SAFETY: valid fds and offsets; the kernel copies between them.
        let n = unsafe {
            libc::copy_file_range(
                sfd,
                &mut off_in,
                dfd,
                &mut off_out,
                (end - off_in as u64) as usize,
                0,
            )
        };
        if n > 0 {
            continue;
        }
        if n == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EXDEV | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => break,
            _ => return Err(e),
        }
    }
    const PAGE: usize = 4096;
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = off_in as u64;
    while pos < end {
        let len = buf.len().min((end - pos) as usize);
        src.read_exact_at(&mut buf[..len], pos)?;
        for (i, page) in buf[..len].chunks(PAGE).enumerate() {
            if page.iter().any(|b| *b != 0) {
                dst.write_all_at(page, pos + (i * PAGE) as u64)?;
            }
        }
        pos += len as u64;
    }
    Ok(())
}

/// Write a complete snapshot to `dir` (which must not exist): everything goes to a temporary
/// sibling first and appears under `dir` only once fully on disk.
pub fn write(dir: &Path, state: &MachineState, memory: MemoryOut) -> Result<SnapshotHeader> {
    let parent_name = match &memory {
        MemoryOut::Diff { parent, .. } => Some(parent_link(dir, parent)?),
        _ => None,
    };
    write_with(dir, state, |tmp| match memory {
        MemoryOut::Image(file) => {
            write_memory(file, state.mem_size, &tmp.join(MEMORY_FILE))?;
            Ok(None)
        }
        MemoryOut::Flatten { ram, written } => {
            let path = tmp.join(MEMORY_FILE);
            diff::flatten(ram, written, &path).map_err(write_err(&path))?;
            Ok(None)
        }
        MemoryOut::Diff {
            ram,
            written,
            parent,
        } => {
            let index = diff::write_diff_files(ram, written, tmp).map_err(write_err(tmp))?;
            let name = parent_name.expect("a diff has a parent name");
            Ok(Some(diff_info(tmp, &index, name, parent)?))
        }
    })
}

/// The name a diff in `dir` gives its parent: the parent's directory name, which must sit
/// beside `dir`.
pub fn parent_link(dir: &Path, parent: &Origin) -> Result<String> {
    let same = |a: &Path, b: &Path| {
        let a = a.canonicalize().ok();
        a.is_some() && a == b.canonicalize().ok()
    };
    let siblings = parent
        .dir
        .parent()
        .is_some_and(|p| same(p, parent_dir_of(dir)));
    match parent.dir.file_name().and_then(|n| n.to_str()) {
        Some(name) if siblings => Ok(name.to_string()),
        _ => Err(SnapshotError::ParentNotSibling {
            dir: dir.to_path_buf(),
            parent: parent.dir.clone(),
        }
        .into()),
    }
}

/// What the header says of a diff whose index (as written into `tmp`) is `index`.
pub fn diff_info(
    tmp: &Path,
    index: &[u8],
    parent_name: String,
    parent: &Origin,
) -> Result<DiffInfo> {
    let runs: Vec<PageRun> =
        bincode::deserialize(index).map_err(|source| SnapshotError::EncodeState {
            dir: tmp.to_path_buf(),
            source,
        })?;
    Ok(DiffInfo {
        parent: parent_name,
        parent_state_sha256: parent.state_sha256.clone(),
        pages: diff::page_count(&runs),
        index_sha256: hex::encode(Sha256::digest(index)),
    })
}

/// [`diff_info`] of the index another process wrote into `tmp`.
pub fn diff_info_written(tmp: &Path, parent_name: String, parent: &Origin) -> Result<DiffInfo> {
    let path = tmp.join(INDEX_FILE);
    let index = fs::read(&path).map_err(write_err(&path))?;
    diff_info(tmp, &index, parent_name, parent)
}

/// Write a snapshot to `dir` with its memory written by `memory` into the directory it is
/// given (returning the diff it wrote, if it wrote one). A `dir` that does not exist appears
/// only once fully on disk: everything goes to a temporary sibling first. An existing empty
/// `dir` is one a caller made for this process to write into (a confined VMM may create
/// nothing beside it): it is written in place, its header last, and the caller (which
/// installs it elsewhere afterwards) removes it on failure.
pub fn write_with(
    dir: &Path,
    state: &MachineState,
    memory: impl FnOnce(&Path) -> Result<Option<DiffInfo>>,
) -> Result<SnapshotHeader> {
    let in_place = fs::read_dir(dir).is_ok_and(|mut d| d.next().is_none());
    if dir.exists() && !in_place {
        return Err(SnapshotError::AlreadyExists {
            dir: dir.to_path_buf(),
        }
        .into());
    }
    let parent = parent_dir_of(dir);
    let tmp: PathBuf = if in_place {
        dir.to_path_buf()
    } else {
        fs::create_dir_all(parent).map_err(write_err(parent))?;
        let name = dir
            .file_name()
            .ok_or_else(|| SnapshotError::NotADirName {
                dir: dir.to_path_buf(),
            })?
            .to_string_lossy();
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir(&tmp).map_err(write_err(&tmp))?;
        tmp
    };
    let result = (|| {
        let diff = memory(&tmp)?;
        let body = bincode::serialize(state).map_err(|source| SnapshotError::EncodeState {
            dir: dir.to_path_buf(),
            source,
        })?;
        let header = SnapshotHeader {
            format: FORMAT_NAME.into(),
            version: FORMAT_VERSION,
            created_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            host: HostIdentity::current(),
            vcpus: state.vcpus.len() as u32,
            mem_size: state.mem_size,
            state_len: body.len() as u64,
            state_sha256: hex::encode(Sha256::digest(&body)),
            diff,
            network: state
                .virtio
                .iter()
                .any(|v| matches!(v.kind, crate::snapshot::devices::VirtioKind::Net { .. })),
            vmgenid: state.vmgenid.is_some(),
            vmgenid_driver: state.vmgenid.and_then(Driver::to_header),
        };
        let header_json =
            serde_json::to_vec_pretty(&header).map_err(|source| SnapshotError::EncodeHeader {
                dir: dir.to_path_buf(),
                source,
            })?;
        write_synced(&tmp.join(STATE_FILE), &body)?;
        write_synced(&tmp.join(HEADER_FILE), &header_json)?;
        fsync_dir(&tmp)?;
        if !in_place {
            fs::rename(&tmp, dir).map_err(write_err(dir))?;
            fsync_dir(parent)?;
        }
        Ok(header)
    })();
    if result.is_err() && !in_place {
        let _ = fs::remove_dir_all(&tmp);
    }
    result
}

/// The directory a snapshot directory sits in.
fn parent_dir_of(dir: &Path) -> &Path {
    dir.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(write_err(path))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(write_err(path))?;
    Ok(())
}

/// A validated snapshot ready to restore: the root's image and, for a diff, the layers above it.
pub struct LoadedSnapshot {
    pub header: SnapshotHeader,
    pub state: MachineState,
    pub memory: File,
    /// Diff layers from the root's child up to this snapshot (empty for a full snapshot).
    pub overlays: Vec<Overlay>,
}

/// Read the header and check it against this host (format version, CPU model, kernel).
pub fn load_header(dir: &Path) -> Result<SnapshotHeader> {
    let path = dir.join(HEADER_FILE);
    let raw = fs::read(&path).map_err(|source| RestoreError::Unreadable {
        path: path.clone(),
        source,
    })?;
    let header: SnapshotHeader =
        serde_json::from_slice(&raw).map_err(|source| RestoreError::CorruptHeader {
            path: path.clone(),
            source,
        })?;
    if header.format != FORMAT_NAME {
        return Err(RestoreError::NotASnapshot {
            path,
            found: header.format,
            expected: FORMAT_NAME,
        }
        .into());
    }
    if header.version != FORMAT_VERSION {
        return Err(RestoreError::Version {
            path,
            found: header.version,
            supported: FORMAT_VERSION,
        }
        .into());
    }
    if let Some(source) = header.host.incompatibility(&HostIdentity::current()) {
        return Err(RestoreError::Host {
            dir: dir.to_path_buf(),
            source,
        }
        .into());
    }
    Ok(header)
}

/// A snapshot's header and machine state, checked, without its memory image (for a restore
/// whose guest RAM is filled by someone else, page by page).
pub struct LoadedState {
    pub header: SnapshotHeader,
    pub state: MachineState,
}

/// Read and check the header and state: host compatibility, sizes, checksum, decoding.
pub fn load_state(dir: &Path) -> Result<LoadedState> {
    load_state_marked(dir, None)
}

/// End step `step` of `marks`, if any are kept.
fn mark(marks: &mut Option<&mut crate::marks::Marks>, step: &'static str) {
    if let Some(m) = marks {
        m.mark(step);
    }
}

fn load_state_marked(
    dir: &Path,
    mut marks: Option<&mut crate::marks::Marks>,
) -> Result<LoadedState> {
    let header = load_header(dir)?;
    mark(&mut marks, "header");
    let state_path = dir.join(STATE_FILE);
    let body = fs::read(&state_path).map_err(|source| RestoreError::Unreadable {
        path: state_path.clone(),
        source,
    })?;
    mark(&mut marks, "state-read");
    if body.len() as u64 != header.state_len {
        return Err(RestoreError::StateSize {
            path: state_path,
            expected: header.state_len,
            actual: body.len() as u64,
        }
        .into());
    }
    let sha256 = hex::encode(Sha256::digest(&body));
    if sha256 != header.state_sha256 {
        return Err(RestoreError::Checksum {
            path: state_path,
            expected: header.state_sha256,
            actual: sha256,
        }
        .into());
    }
    mark(&mut marks, "checksum");
    let mut state: MachineState =
        bincode::deserialize(&body).map_err(|source| RestoreError::Decode {
            path: state_path,
            source,
        })?;
    mark(&mut marks, "decode");
    state.vmgenid = header
        .vmgenid
        .then(|| Driver::from_header(header.vmgenid_driver));
    if state.mem_size != header.mem_size || state.vcpus.len() as u32 != header.vcpus {
        return Err(RestoreError::HeaderStateMismatch {
            dir: dir.to_path_buf(),
            header_vcpus: header.vcpus,
            state_vcpus: state.vcpus.len(),
            header_mem: header.mem_size,
            state_mem: state.mem_size,
        }
        .into());
    }
    Ok(LoadedState { header, state })
}

/// Read and check everything before a single KVM call is made. For a diff, only the headers of
/// its ancestors are read (and checked to be the parents it was taken over), never their
/// state or pages.
pub fn load(dir: &Path) -> Result<LoadedSnapshot> {
    load_marked(dir, None)
}

/// [`load`], its parts marked on `marks` (header, state-read, checksum, decode, chain).
pub fn load_marked(
    dir: &Path,
    mut marks: Option<&mut crate::marks::Marks>,
) -> Result<LoadedSnapshot> {
    let LoadedState { header, state } = load_state_marked(dir, marks.as_deref_mut())?;
    let mut overlays = Vec::new();
    let root = walk_chain(dir, &header, |here, d| {
        overlays.push(load_overlay(here, d, header.mem_size)?);
        Ok(())
    })?;
    overlays.reverse();
    let memory = open_image(&root, header.mem_size)?;
    mark(&mut marks, "chain");
    Ok(LoadedSnapshot {
        header,
        state,
        memory,
        overlays,
    })
}

/// The directory of the full snapshot at the root of `dir`'s diff chain (`dir` itself for a
/// full snapshot), given `dir`'s checked `header`: its `memory.img` is what every child of
/// `dir` maps under the diffs. The chain is checked as a restore checks it.
pub fn root_of(dir: &Path, header: &SnapshotHeader) -> Result<PathBuf> {
    walk_chain(dir, header, |_, _| Ok(()))
}

/// Walk `dir`'s diff chain from `dir` (whose checked header is `header`) to its root, calling
/// `step` with each diff snapshot's directory and diff, child first; returns the root's
/// directory. Each parent must be the one the diff was taken on (same state, same size), and
/// the chain at most [`MAX_CHAIN`] diffs deep.
fn walk_chain(
    dir: &Path,
    header: &SnapshotHeader,
    mut step: impl FnMut(&Path, &DiffInfo) -> Result<()>,
) -> Result<PathBuf> {
    let mut here = dir.to_path_buf();
    let mut at = header.clone();
    let mut depth = 0;
    while let Some(d) = at.diff.clone() {
        if depth >= MAX_CHAIN {
            return Err(RestoreError::ChainTooDeep {
                dir: dir.to_path_buf(),
                max: MAX_CHAIN,
            }
            .into());
        }
        depth += 1;
        step(&here, &d)?;
        let parent = parent_of(&here, &d)?;
        let ph = load_header(&parent)?;
        if ph.state_sha256 != d.parent_state_sha256 {
            return Err(RestoreError::ParentChanged {
                dir: here,
                parent,
                expected: d.parent_state_sha256,
                actual: ph.state_sha256,
            }
            .into());
        }
        if ph.mem_size != header.mem_size {
            return Err(RestoreError::ParentSize {
                dir: here,
                parent,
                expected: header.mem_size,
                actual: ph.mem_size,
            }
            .into());
        }
        here = parent;
        at = ph;
    }
    Ok(here)
}

/// The parent directory a diff in `dir` names, refusing names that leave the directory.
fn parent_of(dir: &Path, d: &DiffInfo) -> Result<PathBuf> {
    let ok = !d.parent.is_empty()
        && !d.parent.starts_with('.')
        && !d.parent.contains('/')
        && d.parent.len() <= 255;
    if !ok {
        return Err(RestoreError::BadParentName {
            dir: dir.to_path_buf(),
            name: d.parent.clone(),
        }
        .into());
    }
    Ok(parent_dir_of(dir).join(&d.parent))
}

/// The pages of the diff snapshot in `dir` (whose checked header is `header`), checked as a
/// restore checks them; None for a complete snapshot.
pub fn diff_pages(dir: &Path, header: &SnapshotHeader) -> Result<Option<Overlay>> {
    header
        .diff
        .as_ref()
        .map(|d| load_overlay(dir, d, header.mem_size))
        .transpose()
}

fn load_overlay(dir: &Path, d: &DiffInfo, mem_size: u64) -> Result<Overlay> {
    let idx_path = dir.join(INDEX_FILE);
    let raw = fs::read(&idx_path).map_err(|source| RestoreError::Unreadable {
        path: idx_path.clone(),
        source,
    })?;
    let bad = |reason: String| RestoreError::BadIndex {
        path: idx_path.clone(),
        reason,
    };
    let sha = hex::encode(Sha256::digest(&raw));
    if sha != d.index_sha256 {
        return Err(bad(format!("SHA-256 {sha}, the header says {}", d.index_sha256)).into());
    }
    let runs: Vec<PageRun> =
        bincode::deserialize(&raw).map_err(|e| bad(format!("does not decode: {e}")))?;
    diff::check_runs(&runs, mem_size, d.pages).map_err(bad)?;
    let file = open_sized(&dir.join(PAGES_FILE), d.pages * diff::PAGE)?;
    Ok(Overlay { file, runs })
}

fn open_image(dir: &Path, mem_size: u64) -> Result<File> {
    open_sized(&dir.join(MEMORY_FILE), mem_size)
}

/// Open a memory file that must be exactly `expected` bytes.
fn open_sized(path: &Path, expected: u64) -> Result<File> {
    let unreadable = |source| RestoreError::Unreadable {
        path: path.to_path_buf(),
        source,
    };
    let file = File::open(path).map_err(unreadable)?;
    let actual = file.metadata().map_err(unreadable)?.len();
    let path = path.to_path_buf();
    if actual < expected {
        return Err(RestoreError::MemoryTruncated {
            path,
            expected,
            actual,
        }
        .into());
    }
    if actual != expected {
        return Err(RestoreError::MemorySize {
            path,
            expected,
            actual,
        }
        .into());
    }
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::snapshot::VmKvmState;

    const MEM: u64 = 1 << 20;

    /// A complete snapshot without KVM: no vCPUs, default device state, 1 MiB of memory.
    fn snapshot(dir: &Path) {
        let state = MachineState {
            vcpus: Vec::new(),
            vm: VmKvmState {
                pit: Default::default(),
                clock: Default::default(),
                pic_master: Default::default(),
                pic_slave: Default::default(),
                ioapic: Default::default(),
            },
            serial: Default::default(),
            virtio: Vec::new(),
            mem_size: MEM,
            vmgenid: Some(Driver::NotBound),
        };
        let memory = tempfile::tempfile().unwrap();
        memory.set_len(MEM).unwrap();
        write(dir, &state, MemoryOut::Image(&memory)).unwrap();
    }

    fn edit_header(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
        let path = dir.join(HEADER_FILE);
        let mut header: serde_json::Value =
            serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
        edit(&mut header);
        fs::write(&path, serde_json::to_vec(&header).unwrap()).unwrap();
    }

    fn restore_error(dir: &Path) -> RestoreError {
        match load(dir) {
            Err(Error::Restore(e)) => e,
            Err(e) => panic!("not a restore error: {e:?}"),
            Ok(_) => panic!("{} loaded", dir.display()),
        }
    }

    #[test]
    fn a_written_snapshot_loads() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("snap");
        snapshot(&dir);
        let loaded = load(&dir).unwrap();
        assert_eq!(loaded.header.mem_size, MEM);
        assert_eq!(loaded.state.mem_size, MEM);
    }

    #[test]
    fn truncated_memory_image_names_the_file_and_both_sizes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("snap");
        snapshot(&dir);
        let image = dir.join(MEMORY_FILE);
        File::options()
            .write(true)
            .open(&image)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let e = restore_error(&dir);
        assert!(
            matches!(&e, RestoreError::MemoryTruncated { path, expected: MEM, actual: 4096 }
                if *path == image),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(&image.display().to_string())
                && msg.contains("4096 bytes, expected 1048576"),
            "{msg}"
        );

        // Longer than the header says is a different mistake: some other snapshot's image.
        fs::write(&image, vec![0u8; MEM as usize + 4096]).unwrap();
        let e = restore_error(&dir);
        assert!(
            matches!(
                e,
                RestoreError::MemorySize {
                    expected: MEM,
                    actual: 1052672,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn wrong_version_and_wrong_format_are_their_own_variants() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("snap");
        snapshot(&dir);
        edit_header(&dir, |h| h["version"] = 99.into());
        let e = restore_error(&dir);
        assert!(
            matches!(
                e,
                RestoreError::Version {
                    found: 99,
                    supported: FORMAT_VERSION,
                    ..
                }
            ),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains(&dir.join(HEADER_FILE).display().to_string())
                && msg.contains("version 99")
                && msg.contains(&format!("reads version {FORMAT_VERSION}")),
            "{msg}"
        );

        edit_header(&dir, |h| h["format"] = "qemu-savevm".into());
        let e = restore_error(&dir);
        assert!(
            matches!(&e, RestoreError::NotASnapshot { found, .. } if found == "qemu-savevm"),
            "{e:?}"
        );
    }

    #[test]
    fn damaged_state_is_told_apart_from_a_missing_one() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("snap");
        snapshot(&dir);
        let state = dir.join(STATE_FILE);
        let mut body = fs::read(&state).unwrap();
        let len = body.len() as u64;

        body[0] ^= 1;
        fs::write(&state, &body).unwrap();
        assert!(
            matches!(restore_error(&dir), RestoreError::Checksum { .. }),
            "same size, other bytes"
        );

        body.pop();
        fs::write(&state, &body).unwrap();
        let e = restore_error(&dir);
        assert!(
            matches!(e, RestoreError::StateSize { expected, actual, .. }
                if expected == len && actual == len - 1),
            "{e:?}"
        );

        fs::remove_file(&state).unwrap();
        let e = restore_error(&dir);
        assert!(
            matches!(&e, RestoreError::Unreadable { path, source }
                if *path == state && source.kind() == std::io::ErrorKind::NotFound),
            "{e:?}"
        );
        // The I/O error stays reachable for callers walking the chain.
        assert!(std::error::Error::source(&e).is_some());
    }

    #[test]
    fn no_snapshot_at_all_names_the_header_file() {
        let tmp = tempfile::tempdir().unwrap();
        let e = restore_error(tmp.path());
        assert!(e.to_string().contains(HEADER_FILE), "{e}");
    }

    #[test]
    fn writing_over_a_snapshot_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let memory = tempfile::tempfile().unwrap();
        let dir = tmp.path().join("snap");
        snapshot(&dir);
        let state = load(&dir).unwrap().state;
        let err = write(&dir, &state, MemoryOut::Image(&memory)).unwrap_err();
        assert!(
            matches!(&err, Error::Snapshot(SnapshotError::AlreadyExists { dir: d }) if *d == dir),
            "{err:?}"
        );
    }
}
