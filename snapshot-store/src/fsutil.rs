//! Crash-safe file publication: write a temp file in the same filesystem,
//! fsync it, rename it into place, fsync the directory. A crash leaves either
//! the old state or the complete new file, never a torn one under the final name.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Result, StoreError};

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A unique temp path inside `tmp_dir` (same filesystem as the final target).
pub fn temp_path(tmp_dir: &Path, hint: &str) -> PathBuf {
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    tmp_dir.join(format!("{hint}.{}.{n}.{nanos}.tmp", std::process::id()))
}

pub fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(StoreError::io("fsync directory", dir))
}

/// Writes `bytes` to `dest` atomically (see module docs).
pub fn write_atomic(tmp_dir: &Path, dest: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(tmp_dir, dest, |f| f.write_all(bytes))
}

/// Like [`write_atomic`] but lets the caller fill the file (e.g. with pwrite).
pub fn write_atomic_with(
    tmp_dir: &Path,
    dest: &Path,
    fill: impl FnOnce(&mut File) -> std::io::Result<()>,
) -> Result<()> {
    let tmp = temp_path(tmp_dir, "write");
    let result = (|| {
        let mut f = File::create(&tmp).map_err(StoreError::io("create temp file", &tmp))?;
        fill(&mut f).map_err(StoreError::io("write temp file", &tmp))?;
        f.sync_all()
            .map_err(StoreError::io("fsync temp file", &tmp))?;
        drop(f);
        publish(&tmp, dest)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Renames a complete, fsynced temp file into place and fsyncs the directory.
pub fn publish(tmp: &Path, dest: &Path) -> Result<()> {
    let parent = dest.parent().expect("destination has a parent directory");
    fs::create_dir_all(parent).map_err(StoreError::io("create directory", parent))?;
    fs::rename(tmp, dest).map_err(StoreError::io("rename into place", dest))?;
    fsync_dir(parent)
}

/// Sets a file's mtime to now (atime untouched): recency for LRU eviction,
/// which cannot rely on atime under `noatime`/`relatime` mounts.
pub fn touch(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let times = [
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_OMIT,
        },
        libc::timespec {
            tv_sec: 0,
            tv_nsec: libc::UTIME_NOW,
        },
    ];
    // SAFETY: a NUL-terminated path and a two-element timespec array, as
    // utimensat(2) requires; neither is retained after the call.
    if unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

pub fn create_dir_all(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(StoreError::io("create directory", dir))
}
