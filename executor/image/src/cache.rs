//! Where downloaded kernels and built images live.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Set to `1` in the environment of commands run by `tine lab`, where the host's files, the
/// cache included, are read-only.
pub const IN_LAB_ENV: &str = "TINE_LAB";

/// `$TINE_CACHE_DIR`, else `$HOME/.cache/tine`, else `/root/.cache/tine`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TINE_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/root"));
    home.join(".cache").join("tine")
}

/// Something had to be added to a cache that lives on a read-only filesystem.
#[derive(Debug, thiserror::Error)]
#[error("{what} is not in the cache yet, and the cache {} is read-only: {hint}", dir.display())]
pub struct ReadOnlyCache {
    pub what: String,
    pub dir: PathBuf,
    pub hint: &'static str,
}

/// Errors with [`ReadOnlyCache`] when `dir` (or, if it does not exist yet, its nearest existing
/// ancestor) is on a read-only filesystem, so callers say what is missing instead of failing
/// on a temporary file.
pub fn ensure_writable(dir: &Path, what: &str) -> Result<(), ReadOnlyCache> {
    if !on_read_only_fs(dir) {
        return Ok(());
    }
    let in_lab = std::env::var_os(IN_LAB_ENV).is_some_and(|v| v == "1");
    Err(ReadOnlyCache {
        what: what.to_string(),
        dir: dir.to_path_buf(),
        hint: if in_lab {
            "inside `tine lab` the host's files are read-only; prepare it on the host first \
             (`tine lab` itself fetches the default guest kernel and builds the smoke \
             initramfs; images: `tine image build NAME`)"
        } else {
            "point TINE_CACHE_DIR (or --cache) at a writable directory"
        },
    })
}

fn on_read_only_fs(path: &Path) -> bool {
    let existing = path
        .ancestors()
        .find(|p| !p.as_os_str().is_empty() && p.exists())
        .unwrap_or(Path::new("."));
    let Ok(c) = CString::new(existing.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a properly sized out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    rc == 0 && st.f_flag & libc::ST_RDONLY != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_writable_directory_passes_even_before_it_exists() {
        // (A read-only filesystem needs privileges to make; the lab tests cover that path.)
        let tmp = tempfile::tempdir().unwrap();
        assert!(ensure_writable(&tmp.path().join("not/yet/there"), "x").is_ok());
        let e = ReadOnlyCache {
            what: "the smoke initramfs".into(),
            dir: "/root/.cache/tine".into(),
            hint: "h",
        };
        assert_eq!(
            e.to_string(),
            "the smoke initramfs is not in the cache yet, and the cache /root/.cache/tine is \
             read-only: h"
        );
    }
}
