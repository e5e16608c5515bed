//! Reading and writing snapshot directories: atomic (temp dir, fsync, rename), checksummed, and
//! validated against the host before anything is restored.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::host_id::HostIdentity;
use super::MachineState;
use crate::error::{Error, Result};

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
}

const FORMAT_NAME: &str = "tine-vm-snapshot";

fn snap_err(dir: &Path, why: impl std::fmt::Display) -> Error {
    Error::Snapshot(format!("{}: {why}", dir.display()))
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}

/// Copy guest RAM from `src` to a new file at `dst`, leaving holes where `src` has none of data.
pub fn write_memory(src: &File, len: u64, dst: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let out = File::create(dst)?;
    out.set_len(len)?;
    let sfd = src.as_raw_fd();
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: plain lseek on a valid fd.
        let data = unsafe { libc::lseek(sfd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // only holes remain
            }
            return Err(e.into());
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(sfd, data, libc::SEEK_HOLE) };
        let end = if hole < 0 {
            len as i64
        } else {
            (hole as u64).min(len) as i64
        };
        copy_range(src, &out, data as u64, end as u64)?;
        pos = end;
    }
    out.sync_all()?;
    Ok(())
}

/// Copy `[start, end)` between files: in the kernel when it can (same filesystem), else
/// through a buffer that skips all-zero pages so the copy stays sparse.
fn copy_range(src: &File, dst: &File, start: u64, end: u64) -> Result<()> {
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
            _ => return Err(e.into()),
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
pub fn write(dir: &Path, state: &MachineState, memory: &File) -> Result<SnapshotHeader> {
    if dir.exists() {
        return Err(snap_err(dir, "already exists"));
    }
    let parent = dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    fs::create_dir_all(parent)?;
    let name = dir
        .file_name()
        .ok_or_else(|| snap_err(dir, "not a directory name"))?
        .to_string_lossy();
    let tmp: PathBuf = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let _ = fs::remove_dir_all(&tmp);
    fs::create_dir(&tmp)?;
    let result = (|| {
        let body =
            bincode::serialize(state).map_err(|e| snap_err(dir, format!("encoding state: {e}")))?;
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
        };
        write_memory(memory, state.mem_size, &tmp.join(MEMORY_FILE))?;
        let mut f = File::create(tmp.join(STATE_FILE))?;
        f.write_all(&body)?;
        f.sync_all()?;
        let mut f = File::create(tmp.join(HEADER_FILE))?;
        f.write_all(&serde_json::to_vec_pretty(&header).map_err(|e| snap_err(dir, e))?)?;
        f.sync_all()?;
        fsync_dir(&tmp)?;
        fs::rename(&tmp, dir)?;
        fsync_dir(parent)?;
        Ok(header)
    })();
    if result.is_err() {
        let _ = fs::remove_dir_all(&tmp);
    }
    result
}

/// A validated snapshot ready to restore.
pub struct LoadedSnapshot {
    pub header: SnapshotHeader,
    pub state: MachineState,
    pub memory: File,
}

/// Read the header and check it against this host (format version, CPU model, kernel).
pub fn load_header(dir: &Path) -> Result<SnapshotHeader> {
    let raw = fs::read(dir.join(HEADER_FILE))
        .map_err(|e| snap_err(dir, format!("no readable {HEADER_FILE}: {e}")))?;
    let header: SnapshotHeader = serde_json::from_slice(&raw)
        .map_err(|e| snap_err(dir, format!("{HEADER_FILE} is corrupt: {e}")))?;
    if header.format != FORMAT_NAME || header.version != FORMAT_VERSION {
        return Err(snap_err(
            dir,
            format!(
                "format {} v{} is not supported (this build reads {FORMAT_NAME} v{FORMAT_VERSION})",
                header.format, header.version
            ),
        ));
    }
    if let Some(why) = header.host.incompatibility(&HostIdentity::current()) {
        return Err(snap_err(dir, why));
    }
    Ok(header)
}

/// Read and check everything before a single KVM call is made.
pub fn load(dir: &Path) -> Result<LoadedSnapshot> {
    let header = load_header(dir)?;
    let body = fs::read(dir.join(STATE_FILE))
        .map_err(|e| snap_err(dir, format!("no readable {STATE_FILE}: {e}")))?;
    if body.len() as u64 != header.state_len {
        return Err(snap_err(
            dir,
            format!(
                "{STATE_FILE} is {} bytes, header says {}: truncated or replaced",
                body.len(),
                header.state_len
            ),
        ));
    }
    if hex::encode(Sha256::digest(&body)) != header.state_sha256 {
        return Err(snap_err(
            dir,
            format!("{STATE_FILE} checksum mismatch: the file is corrupted"),
        ));
    }
    let state: MachineState = bincode::deserialize(&body)
        .map_err(|e| snap_err(dir, format!("{STATE_FILE} does not decode: {e}")))?;
    if state.mem_size != header.mem_size || state.vcpus.len() as u32 != header.vcpus {
        return Err(snap_err(dir, "header and state disagree"));
    }
    let memory = File::open(dir.join(MEMORY_FILE))
        .map_err(|e| snap_err(dir, format!("no readable {MEMORY_FILE}: {e}")))?;
    let len = memory.metadata()?.len();
    if len != header.mem_size {
        return Err(snap_err(
            dir,
            format!(
                "{MEMORY_FILE} is {len} bytes, expected {}: truncated",
                header.mem_size
            ),
        ));
    }
    Ok(LoadedSnapshot {
        header,
        state,
        memory,
    })
}
