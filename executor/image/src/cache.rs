//! Where downloaded kernels and built images live.

use std::path::PathBuf;

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
