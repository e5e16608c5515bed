//! The on-disk record of each VM a host runs: `vms/<id>/` holds `meta.json` (this record),
//! `vsock.sock`, `console.log` and `vmm.log`. Records are read back after a restart, so
//! everything in them is checked again on load (ids re-validated, processes re-identified).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tine_proto::names::{SandboxId, Tag};

use crate::cgroup::CgroupName;
use crate::config::Owner;
use crate::error::{HostError, Result};
use crate::process::{Liveness, ProcessIdentity};

const META: &str = "meta.json";
/// Bumped when the record's meaning changes; older records are skipped (never adopted).
const RECORD_VERSION: u32 = 2;

#[derive(Serialize, Deserialize)]
struct RecordFile {
    version: u32,
    id: String,
    tag: Option<String>,
    owner: Owner,
    process: ProcessIdentity,
    created_unix_ms: u64,
    /// Made ready (clock and RNG its own); a daemon adopts only such VMs.
    #[serde(default)]
    ready: bool,
    /// Restored lazily (its pages come from the daemon); absent in older records.
    #[serde(default)]
    pages_from_host: bool,
    /// Its network namespace; absent in older records and for VMs without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    net: Option<String>,
    /// Its cgroup's name; absent in older records (a cgroup named by its id, if any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    cgroup: Option<String>,
}

/// One VM as recorded on disk.
#[derive(Clone, Debug)]
pub struct VmRecord {
    pub id: SandboxId,
    /// The snapshot it was forked from (None: a booted parent).
    pub tag: Option<Tag>,
    pub owner: Owner,
    pub process: ProcessIdentity,
    pub created_unix_ms: u64,
    /// Made ready: its agent answered and its clock and RNG are its own.
    pub ready: bool,
    /// Restored lazily: its untouched pages come from this host's daemon, so it cannot
    /// outlive that daemon (never re-adopted).
    pub pages_from_host: bool,
    pub dir: PathBuf,
    /// Its network namespace (see [`crate::network`]), removed with it.
    pub net: Option<String>,
    /// Its cgroup (see [`crate::cgroup`]), removed with it. None: one named by its id, if any.
    pub cgroup: Option<CgroupName>,
}

impl VmRecord {
    pub fn liveness(&self) -> Liveness {
        self.process.liveness()
    }

    /// The name of its cgroup, if it has one.
    pub fn cgroup_name(&self) -> CgroupName {
        self.cgroup
            .clone()
            .unwrap_or_else(|| CgroupName::of(&self.id))
    }

    /// Write `dir/meta.json` atomically (temp file, fsync, rename).
    pub fn write(&self) -> Result<()> {
        self.write_with(true)
    }

    /// [`write`](Self::write) without the fsync, for updates whose loss in a crash is safe.
    pub fn write_unsynced(&self) -> Result<()> {
        self.write_with(false)
    }

    fn write_with(&self, sync: bool) -> Result<()> {
        use std::io::Write;
        let file = RecordFile {
            version: RECORD_VERSION,
            id: self.id.to_string(),
            tag: self.tag.as_ref().map(|t| t.to_string()),
            owner: self.owner.clone(),
            process: self.process.clone(),
            created_unix_ms: self.created_unix_ms,
            ready: self.ready,
            pages_from_host: self.pages_from_host,
            net: self.net.clone(),
            cgroup: self.cgroup.as_ref().map(|c| c.as_str().to_string()),
        };
        let tmp = self.dir.join("meta.json.tmp");
        let ctx = format!("writing {}", tmp.display());
        let mut f = std::fs::File::create(&tmp).map_err(HostError::io(&ctx))?;
        f.write_all(&serde_json::to_vec_pretty(&file).expect("record serializes"))
            .and_then(|()| if sync { f.sync_all() } else { Ok(()) })
            .map_err(HostError::io(&ctx))?;
        std::fs::rename(&tmp, self.dir.join(META)).map_err(HostError::io(ctx))
    }

    /// Read `dir/meta.json`; None for a missing, unreadable, foreign or outdated record.
    pub fn read(dir: &Path) -> Option<VmRecord> {
        let raw = std::fs::read(dir.join(META)).ok()?;
        let f: RecordFile = serde_json::from_slice(&raw).ok()?;
        if f.version != RECORD_VERSION {
            return None;
        }
        let id = SandboxId::parse(f.id).ok()?;
        // The directory name is the id: a record copied elsewhere is not that VM.
        if dir.file_name()?.to_str()? != id.as_str() {
            return None;
        }
        Some(VmRecord {
            id,
            tag: f.tag.and_then(|t| Tag::parse(t).ok()),
            owner: f.owner,
            process: f.process,
            created_unix_ms: f.created_unix_ms,
            ready: f.ready,
            pages_from_host: f.pages_from_host,
            dir: dir.to_path_buf(),
            // Only a name the network code made: a record never names anything else to remove.
            net: f.net.filter(|n| crate::network::is_child_network(n)),
            // Likewise a cgroup's name, never a path.
            cgroup: f.cgroup.as_deref().and_then(CgroupName::parse),
        })
    }
}

/// Every readable record under `vms_dir`, oldest first.
pub fn list(vms_dir: &Path) -> Vec<VmRecord> {
    let Ok(entries) = std::fs::read_dir(vms_dir) else {
        return Vec::new();
    };
    let mut out: Vec<VmRecord> = entries
        .flatten()
        .filter_map(|e| VmRecord::read(&e.path()))
        .collect();
    out.sort_by(|a, b| {
        a.created_unix_ms
            .cmp(&b.created_unix_ms)
            .then(a.id.cmp(&b.id))
    });
    out
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
