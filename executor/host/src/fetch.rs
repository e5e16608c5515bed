//! Getting a snapshot this host lacks from the cluster's store, in one of two ways:
//! eagerly (fetch every layer it lacks, assemble the flat image, restore children
//! copy-on-write from it) or lazily (children start at once and their pages arrive on first
//! touch, see [`crate::lazy`], while the flat image is fetched in the background for the
//! children that come after).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use tine_proto::names::{SandboxId, Tag};
use tine_snapshot_store::Digest;

use crate::error::{HostError, Result};
use crate::layers::{Fetched, Layers};
use crate::lazy::LazyImage;

/// How a host restores a snapshot whose layers are only in the store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FetchMode {
    /// Fetch and assemble the whole image before the first child restores.
    #[default]
    Eager,
    /// Start children at once, supplying pages on first touch; with `prefetch`, copy in the
    /// working set recorded by an earlier lazy restore before the guest asks for it.
    Lazy { prefetch: bool },
}

impl std::str::FromStr for FetchMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "eager" => Ok(FetchMode::Eager),
            "lazy" => Ok(FetchMode::Lazy { prefetch: true }),
            "lazy-no-prefetch" => Ok(FetchMode::Lazy { prefetch: false }),
            other => Err(format!(
                "unknown fetch mode {other:?} (eager, lazy, lazy-no-prefetch)"
            )),
        }
    }
}

impl std::fmt::Display for FetchMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            FetchMode::Eager => "eager",
            FetchMode::Lazy { prefetch: true } => "lazy",
            FetchMode::Lazy { prefetch: false } => "lazy-no-prefetch",
        })
    }
}

/// Where a spawn's children get their snapshot from.
pub(crate) enum Source {
    /// The snapshot directory on this host (made here or fetched).
    Local,
    /// Pages on demand while the image is fetched.
    Lazy(Arc<LazyImage>),
}

pub(crate) struct Fetcher {
    pub layers: Layers,
    snapshots_dir: PathBuf,
    lazy_dir: PathBuf,
    mode: FetchMode,
    /// One full fetch per snapshot at a time: concurrent spawns fetch it once.
    fetching: Mutex<HashMap<Tag, Arc<Mutex<()>>>>,
    /// Snapshots being served lazily until their image is here.
    lazy: Mutex<HashMap<Tag, Arc<LazyImage>>>,
    /// Upper bound on the layer cache (None: unbounded).
    cache_max_bytes: Option<u64>,
    /// Held (shared) by every spawn and publish; eviction takes it exclusively, so it never
    /// removes an image a spawn is about to hand to a worker.
    in_flight: RwLock<()>,
    /// Something entered the cache since the last eviction pass.
    grew: AtomicBool,
}

impl Fetcher {
    pub fn new(
        layers: Layers,
        snapshots_dir: PathBuf,
        lazy_dir: PathBuf,
        mode: FetchMode,
        cache_max_bytes: Option<u64>,
    ) -> Self {
        Fetcher {
            layers,
            snapshots_dir,
            lazy_dir,
            mode,
            fetching: Mutex::default(),
            lazy: Mutex::default(),
            cache_max_bytes,
            in_flight: RwLock::default(),
            grew: AtomicBool::new(true),
        }
    }

    /// Held for the length of a spawn or a publish (see `in_flight`).
    pub fn in_flight(&self) -> std::sync::RwLockReadGuard<'_, ()> {
        self.in_flight.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Note that the cache grew (a publish, a fetch).
    pub fn grew(&self) {
        self.grew.store(true, Ordering::Release);
    }

    /// Keep the layer cache under its bound: evict images and layers of snapshots no child on
    /// this host runs from (`live_tags`) and no lazy restore serves, least recently used
    /// first. A fetched snapshot whose image goes is removed too (fetched again when next
    /// asked for). Skipped while a spawn or publish is in flight (the next one retries).
    /// Returns the directories of the fetched snapshots it removed.
    pub fn enforce_bound(&self, live_tags: &HashSet<Tag>) -> Vec<PathBuf> {
        let mut removed = Vec::new();
        let Some(max) = self.cache_max_bytes else {
            return removed;
        };
        if !self.grew.load(Ordering::Acquire) {
            return removed;
        }
        let Ok(_quiet) = self.in_flight.try_write() else {
            return removed;
        };
        self.grew.store(false, Ordering::Release);
        let images = self
            .layers
            .cache()
            .root()
            .join(tine_snapshot_store::cache::IMAGES_DIR);
        // Fetched snapshots: their memory image is a link into the cache.
        let mut fetched: Vec<(PathBuf, Digest, bool)> = Vec::new();
        if let Ok(entries) = std::fs::read_dir(&self.snapshots_dir) {
            for e in entries.flatten() {
                let Ok(target) =
                    std::fs::read_link(e.path().join(tine_vmm::snapshot::file::MEMORY_FILE))
                else {
                    continue;
                };
                let head = target
                    .strip_prefix(&images)
                    .ok()
                    .and_then(|n| n.to_str())
                    .and_then(|n| n.strip_suffix(".mem"))
                    .and_then(|h| Digest::parse(h).ok());
                let Some(head) = head else { continue };
                let live = e
                    .file_name()
                    .to_str()
                    .and_then(|n| Tag::parse(n).ok())
                    .is_some_and(|t| live_tags.contains(&t));
                fetched.push((e.path(), head, live));
            }
        }
        let mut in_use: HashSet<Digest> = fetched.iter().filter(|f| f.2).map(|f| f.1).collect();
        in_use.extend(
            self.lazy
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .map(|i| i.head),
        );
        match self.layers.cache().evict_to(max, &|d| in_use.contains(d)) {
            Ok(r) => {
                if !r.removed_images.is_empty() || !r.removed_layers.is_empty() {
                    tracing::info!(
                        before_mib = r.before.total() >> 20,
                        after_mib = r.after.total() >> 20,
                        max_mib = max >> 20,
                        images = r.removed_images.len(),
                        layers = r.removed_layers.len(),
                        objects = r.objects_removed,
                        "layer cache trimmed"
                    );
                }
                if !r.within_bound() {
                    // Try again at the next chance: what is in use now may not be then.
                    self.grew();
                    tracing::warn!(
                        used_mib = r.after.total() >> 20,
                        max_mib = max >> 20,
                        "the layer cache stays over its bound: what is left is in use"
                    );
                }
                for (dir, head, _) in fetched {
                    if r.removed_images.contains(&head) {
                        let _ = std::fs::remove_dir_all(&dir);
                        removed.push(dir);
                    }
                }
            }
            Err(e) => tracing::warn!("trimming the layer cache: {e}"),
        }
        removed
    }

    /// Remove what lazy restores of a previous daemon left (their children died with it).
    pub fn sweep(&self) {
        let _ = std::fs::remove_dir_all(&self.lazy_dir);
    }

    fn local(&self, tag: &Tag) -> bool {
        self.snapshots_dir
            .join(tag.as_str())
            .join("snapshot.json")
            .is_file()
    }

    /// How children of `tag` (head `head`) restore here, fetching first if this host's mode
    /// (or `mode`, when given) says so.
    pub fn source(&self, tag: &Tag, head: &Digest, mode: Option<FetchMode>) -> Result<Source> {
        if self.local(tag) {
            return Ok(Source::Local);
        }
        match mode.unwrap_or(self.mode) {
            FetchMode::Eager => {
                self.ensure_local(tag, head)?;
                Ok(Source::Local)
            }
            FetchMode::Lazy { prefetch } => Ok(Source::Lazy(self.lazy_image(tag, head, prefetch)?)),
        }
    }

    fn lazy_image(&self, tag: &Tag, head: &Digest, prefetch: bool) -> Result<Arc<LazyImage>> {
        // Under the lock: concurrent spawns of a cold snapshot set it up once.
        let mut lazy = self.lazy.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(img) = lazy.get(tag).filter(|i| i.head == *head) {
            return Ok(img.clone());
        }
        let t0 = Instant::now();
        let dir = self.lazy_dir.join(SandboxId::random(tag.as_str()).as_str());
        std::fs::create_dir_all(&dir)
            .map_err(HostError::io(format!("creating {}", dir.display())))?;
        let img = LazyImage::open(&self.layers, tag, head, dir.clone(), prefetch);
        let img = match img {
            Ok(i) => i,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&dir);
                return Err(e);
            }
        };
        tracing::info!(
            %tag,
            %head,
            prefetch = img.working_set.as_ref().map_or(0, |w| w.len()),
            took_ms = t0.elapsed().as_millis() as u64,
            "serving snapshot lazily from the store"
        );
        lazy.insert(tag.clone(), img.clone());
        Ok(img)
    }

    /// Fetch `tag`'s image in the background, after which its children map it (and the
    /// lazily served entry is dropped; children already running keep theirs).
    pub fn fill_in_background(self: &Arc<Self>, tag: &Tag, head: &Digest) {
        let (me, tag, head) = (self.clone(), tag.clone(), *head);
        let spawned = std::thread::Builder::new()
            .name("tine-fill".into())
            .spawn(move || {
                match me.ensure_local(&tag, &head) {
                    Ok(_) => {}
                    Err(e) => tracing::warn!(%tag, "fetching the image in the background: {e}"),
                }
                me.lazy
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&tag);
            });
        if let Err(e) = spawned {
            tracing::warn!("starting the background fetch: {e}");
        }
    }

    /// Make sure snapshot `tag` is on this host: if not, fetch the layers of `head` it lacks
    /// from the store and set the snapshot up from them. Returns what was fetched (None: the
    /// snapshot was here already).
    pub fn ensure_local(&self, tag: &Tag, head: &Digest) -> Result<Option<Fetched>> {
        let dir = self.snapshots_dir.join(tag.as_str());
        if self.local(tag) {
            return Ok(None);
        }
        let gate = self
            .fetching
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tag.clone())
            .or_default()
            .clone();
        let _one_fetch = gate.lock().unwrap_or_else(|p| p.into_inner());
        if self.local(tag) {
            return Ok(None); // another spawn fetched it while we waited
        }
        let _s = tracing::info_span!("spawn.fetch", %tag, %head).entered();
        let t0 = Instant::now();
        let staging = self.snapshots_dir.join(format!(
            ".fetch-{}",
            SandboxId::random(tag.as_str()).as_str()
        ));
        let fetched = self.layers.materialize(tag, head, &staging).and_then(|f| {
            std::fs::rename(&staging, &dir)
                .map(|()| f)
                .map_err(HostError::io(format!(
                    "moving the snapshot to {}",
                    dir.display()
                )))
        });
        if fetched.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        let fetched = fetched?;
        self.grew();
        tracing::info!(
            %tag,
            %head,
            layers = fetched.layers,
            objects = fetched.objects,
            bytes = fetched.bytes,
            took_ms = t0.elapsed().as_millis() as u64,
            "fetched snapshot from the store"
        );
        Ok(Some(fetched))
    }
}
