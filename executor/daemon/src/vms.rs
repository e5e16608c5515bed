//! Local bookkeeping for snapshots and running VMs under the data directory:
//! `snapshots/<tag>/` (VM snapshot directories) and `vms/<id>/` (one per running VMM process:
//! `meta.json`, `vsock.sock`, `console.log`, `vmm.log`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

pub fn data_dir() -> Result<PathBuf> {
    tine_snapshot_store::cli::data_dir()
}

/// The snapshot directory for `tag`, after checking the tag is safe to use as a path.
pub fn snapshot_dir(tag: &str) -> Result<PathBuf> {
    tine_snapshot_store::tag::validate_tag(tag).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(data_dir()?.join("snapshots").join(tag))
}

pub fn vms_dir() -> Result<PathBuf> {
    Ok(data_dir()?.join("vms"))
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VmMeta {
    pub id: String,
    pub pid: u32,
    /// Snapshot tag it was forked from, or None for a booted VM.
    pub tag: Option<String>,
    pub created_unix_ms: u64,
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn new_id(prefix: &str) -> String {
    let mut b = [0u8; 4];
    getrandom::fill(&mut b).expect("getrandom");
    format!("{prefix}-{}", hex::encode(b))
}

pub fn write_meta(dir: &Path, meta: &VmMeta) -> Result<()> {
    let tmp = dir.join("meta.json.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(meta)?)?;
    std::fs::rename(&tmp, dir.join("meta.json"))?;
    Ok(())
}

/// Whether the process runs (a zombie, exited but not yet reaped, does not count).
pub fn alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state letter follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

pub fn list() -> Result<Vec<(PathBuf, VmMeta)>> {
    let dir = vms_dir()?;
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let p = e.path();
        if let Ok(raw) = std::fs::read(p.join("meta.json")) {
            if let Ok(m) = serde_json::from_slice::<VmMeta>(&raw) {
                out.push((p, m));
            }
        }
    }
    out.sort_by(|a, b| {
        a.1.created_unix_ms
            .cmp(&b.1.created_unix_ms)
            .then(a.1.id.cmp(&b.1.id))
    });
    Ok(out)
}

/// Kill a VM's process and remove its directory.
pub fn kill(dir: &Path, meta: &VmMeta) -> Result<()> {
    if alive(meta.pid) {
        // SAFETY: plain kill(2) of a pid we started.
        unsafe { libc::kill(meta.pid as i32, libc::SIGKILL) };
        for _ in 0..200 {
            // Reap it if it is our child (forked by this process); harmless otherwise.
            // SAFETY: non-blocking waitpid on a specific pid.
            unsafe { libc::waitpid(meta.pid as i32, std::ptr::null_mut(), libc::WNOHANG) };
            if !alive(meta.pid) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))
}

pub fn find(id: &str) -> Result<(PathBuf, VmMeta)> {
    if id.contains('/') || id.contains("..") {
        bail!("bad VM id {id:?}");
    }
    list()?
        .into_iter()
        .find(|(_, m)| m.id == id)
        .with_context(|| format!("no VM {id} (see `tine ls`)"))
}
