//! Garbage collection: mark every object referenced by a layer manifest in
//! the store, sweep the rest.
//!
//! Safety against a concurrent push (which uploads objects first, manifests
//! after, and may skip an object it saw already present):
//! * A push holds a lease object `locks/push-<id>` for its whole duration and
//!   GC holds `locks/gc`. Each side first writes its own lock, then looks for
//!   the other's; on a linearizable store (S3 is, since 2020; so is a local
//!   directory) at least one of the two sees the other and backs off, so a
//!   sweep never overlaps a push.
//! * Belt and braces: objects younger than `min_age` are never swept, which
//!   covers writers that predate leases or crashed mid-push within the window.
//!
//! Stale locks (older than their TTL: crashed process) are ignored.

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use bytes::Bytes;

use crate::cache::{layer_key, LocalCache, CHUNKS_DIR, IMAGES_DIR, LAYERS_DIR};
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::remote::RemoteStore;

pub const LOCKS_DIR: &str = "locks";
/// Per-head side objects (`<dir>/<head hex>`, e.g. a recorded working set): swept with
/// their layer.
pub const SIDE_DIRS: [&str; 1] = ["workingsets"];
const GC_LOCK: &str = "locks/gc";
/// A push lease older than this is a crashed pusher's.
pub const PUSH_LEASE_TTL: Duration = Duration::from_secs(6 * 3600);
/// A GC lock older than this is a crashed collector's.
pub const GC_LOCK_TTL: Duration = Duration::from_secs(3600);

fn age(meta: &object_store::ObjectMeta) -> Duration {
    let modified: SystemTime = meta.last_modified.into();
    SystemTime::now()
        .duration_since(modified)
        .unwrap_or_default()
}

fn random_id() -> String {
    let mut b = [0u8; 12];
    if getrandom::fill(&mut b).is_err() {
        // Uniqueness, not secrecy, is what matters here.
        let n = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        b.copy_from_slice(&n.to_le_bytes()[..12]);
    }
    hex::encode(b)
}

/// Held by a push for its whole duration (see module docs).
#[derive(Debug)]
pub struct PushLease {
    key: String,
}

impl PushLease {
    pub async fn acquire(store: &RemoteStore) -> Result<Self> {
        let key = format!("{LOCKS_DIR}/push-{}", random_id());
        store
            .put_overwrite(&key, Bytes::from_static(b"push lease\n"))
            .await?;
        let lease = PushLease { key };
        for meta in store.list(LOCKS_DIR).await? {
            if meta.location.as_ref() == GC_LOCK && age(&meta) < GC_LOCK_TTL {
                lease.release(store).await;
                return Err(StoreError::Gc(format!(
                    "garbage collection is running on {} (lock {GC_LOCK}); retry the push when it finishes",
                    store.description()
                )));
            }
        }
        Ok(lease)
    }

    /// Best effort: a lease that cannot be deleted expires after its TTL.
    pub async fn release(self, store: &RemoteStore) {
        if let Err(e) = store.delete(&self.key).await {
            tracing::warn!(%e, key = %self.key, "could not release push lease");
        }
    }
}

#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Never delete objects (or layers) younger than this.
    pub min_age: Duration,
    /// Also delete layers not reachable from any tag (older than min_age).
    pub prune_untagged: bool,
    /// Report what would be deleted without deleting.
    pub dry_run: bool,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            min_age: Duration::from_secs(3600),
            prune_untagged: false,
            dry_run: false,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub layers_live: u64,
    pub layers_deleted: u64,
    pub objects_live: u64,
    pub objects_deleted: u64,
    pub bytes_deleted: u64,
    /// Unreferenced objects kept because they are younger than min_age.
    pub objects_too_young: u64,
    /// Side objects (working sets) whose layer is gone.
    pub side_objects_deleted: u64,
}

/// Collects garbage in a store (remote or a directory).
pub async fn collect_garbage(store: &RemoteStore, opts: &GcOptions) -> Result<GcReport> {
    acquire_gc_lock(store).await?;
    let result = collect_locked(store, opts).await;
    if let Err(e) = store.delete(GC_LOCK).await {
        tracing::warn!(%e, "could not release {GC_LOCK}");
    }
    result
}

async fn acquire_gc_lock(store: &RemoteStore) -> Result<()> {
    if !store
        .put_if_absent(GC_LOCK, Bytes::from_static(b"gc\n"))
        .await?
    {
        let metas = store.list(LOCKS_DIR).await?;
        let held = metas.iter().find(|m| m.location.as_ref() == GC_LOCK);
        if let Some(m) = held.filter(|m| age(m) < GC_LOCK_TTL) {
            return Err(StoreError::Gc(format!(
                "another garbage collection holds {GC_LOCK} (taken {}s ago)",
                age(m).as_secs()
            )));
        }
        store
            .put_overwrite(GC_LOCK, Bytes::from_static(b"gc\n"))
            .await?; // stale
    }
    for meta in store.list(LOCKS_DIR).await? {
        let name = meta.location.filename().unwrap_or_default();
        if name.starts_with("push-") && age(&meta) < PUSH_LEASE_TTL {
            let _ = store.delete(GC_LOCK).await;
            return Err(StoreError::Gc(format!(
                "a push is in progress on {} (lease {}); retry when it finishes",
                store.description(),
                meta.location
            )));
        }
    }
    Ok(())
}

async fn collect_locked(store: &RemoteStore, opts: &GcOptions) -> Result<GcReport> {
    let mut report = GcReport::default();
    let mut layers = list_layers(store).await?;

    if opts.prune_untagged {
        let mut reachable = HashSet::new();
        for (_, head) in store.list_tags().await? {
            let mut next = Some(head);
            while let Some(d) = next {
                if !reachable.insert(d) {
                    break;
                }
                next = match store.get_layer(&d).await {
                    Ok(l) => l.parent(),
                    Err(StoreError::RemoteLayerMissing(_)) => None,
                    Err(e) => return Err(e),
                };
            }
        }
        let mut kept = Vec::new();
        for (d, meta) in layers {
            if reachable.contains(&d) || age(&meta) < opts.min_age {
                kept.push((d, meta));
                continue;
            }
            if !opts.dry_run {
                store.delete(&layer_key(&d)).await?;
            }
            report.layers_deleted += 1;
        }
        layers = kept;
    }

    // Mark. An unreadable manifest aborts the sweep: its objects' liveness is unknown.
    let mut live = HashSet::new();
    for (d, _) in &layers {
        let layer = match store.get_layer(d).await {
            Ok(l) => l,
            Err(StoreError::RemoteLayerMissing(_)) => continue, // deleted meanwhile
            Err(e) => {
                return Err(StoreError::Gc(format!(
                    "cannot read layer {d}, nothing swept: {e}"
                )))
            }
        };
        for o in layer.object_refs() {
            live.insert(Digest::from_bytes(&o.hash)?);
        }
    }
    report.layers_live = layers.len() as u64;

    // Side objects of layers that are gone.
    let live_layers: HashSet<Digest> = layers.iter().map(|(d, _)| *d).collect();
    for dir in SIDE_DIRS {
        for meta in store.list(dir).await? {
            let Some(d) = meta.location.filename().and_then(|n| Digest::parse(n).ok()) else {
                continue;
            };
            if live_layers.contains(&d) || age(&meta) < opts.min_age {
                continue;
            }
            if !opts.dry_run {
                store.delete(meta.location.as_ref()).await?;
            }
            report.side_objects_deleted += 1;
        }
    }

    // Sweep.
    for meta in store.list(CHUNKS_DIR).await? {
        let Some(d) = meta.location.filename().and_then(|n| Digest::parse(n).ok()) else {
            continue;
        };
        if live.contains(&d) {
            report.objects_live += 1;
            continue;
        }
        if age(&meta) < opts.min_age {
            report.objects_too_young += 1;
            continue;
        }
        if !opts.dry_run {
            store.delete(meta.location.as_ref()).await?;
        }
        report.objects_deleted += 1;
        report.bytes_deleted += meta.size;
    }
    Ok(report)
}

async fn list_layers(store: &RemoteStore) -> Result<Vec<(Digest, object_store::ObjectMeta)>> {
    let mut out = Vec::new();
    for meta in store.list(LAYERS_DIR).await? {
        if let Some(d) = meta.location.filename().and_then(|n| Digest::parse(n).ok()) {
            out.push((d, meta));
        }
    }
    Ok(out)
}

/// GC of the local cache: the same mark and sweep over its directory, then
/// removal of assembled images whose head layer is gone.
pub async fn collect_cache_garbage(
    cache: &LocalCache,
    opts: &GcOptions,
) -> Result<(GcReport, u64)> {
    let view = RemoteStore::open_local(cache.root())?;
    let report = collect_garbage(&view, opts).await?;
    let mut images_deleted = 0;
    let dir = cache.root().join(IMAGES_DIR);
    for entry in std::fs::read_dir(&dir).map_err(StoreError::io("list images", &dir))? {
        let entry = entry.map_err(StoreError::io("list images", &dir))?;
        let name = entry.file_name();
        let Some(hex) = name.to_str().and_then(|n| n.strip_suffix(".mem")) else {
            continue;
        };
        let Ok(head) = Digest::parse(hex) else {
            continue;
        };
        if !cache.has_layer(&head) {
            if !opts.dry_run {
                std::fs::remove_file(entry.path())
                    .map_err(StoreError::io("remove image", entry.path()))?;
            }
            images_deleted += 1;
        }
    }
    Ok((report, images_deleted))
}
