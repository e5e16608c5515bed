//! The local cache: a content-addressed directory holding verified objects
//! (zstd chunks and state blobs), verified layer manifests, tags and the
//! assembled flat images. Its key layout matches the remote store's, so the
//! same garbage collector can walk both.
//!
//! ```text
//! <root>/chunks/ab/<hex>   zstd objects, hash of the stored bytes
//! <root>/layers/<hex>      manifest bytes, hash = layer digest
//! <root>/tags/<tag>        "<hex>\n"
//! <root>/images/<hex>.mem  assembled flat image of head <hex> (sparse)
//! <root>/tmp/              temp files and import staging (same filesystem)
//! <root>/cache.lock        flock: shared by writers, exclusive for eviction
//! ```
//!
//! Objects are verified exactly once, when they enter (put_object_verified or
//! because this process computed their hash); reads never re-hash them.
//!
//! Every file appears by rename of a complete, fsynced temp file, and a
//! manifest only after all its objects and its parent, so whatever a killed
//! process leaves behind is either valid or in `tmp/`. Writers (pull, build,
//! import, assembly, tag and object puts) hold `cache.lock` shared for the
//! whole operation; [`LocalCache::evict_to`] and the `tmp/` sweep at
//! [`LocalCache::open`] take it exclusively, so they never see an operation
//! half done: an object that no manifest names is debris, not a pull
//! between its objects and its manifests.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::fs::{self, File};
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::fsutil;
use crate::manifest::{pb, Layer};
use crate::tag::validate_tag;

pub const CHUNKS_DIR: &str = "chunks";
pub const LAYERS_DIR: &str = "layers";
pub const TAGS_DIR: &str = "tags";
pub const IMAGES_DIR: &str = "images";
pub const TMP_DIR: &str = "tmp";
pub const LOCK_FILE: &str = "cache.lock";

/// Object key shared by cache and remote store.
pub fn object_key(d: &Digest) -> String {
    let hex = d.hex();
    format!("{CHUNKS_DIR}/{}/{hex}", &hex[..2])
}

pub fn layer_key(d: &Digest) -> String {
    format!("{LAYERS_DIR}/{}", d.hex())
}

pub fn tag_key(tag: &str) -> String {
    format!("{TAGS_DIR}/{tag}")
}

/// Parses a tag file's contents.
pub fn parse_tag_value(tag: &str, bytes: &[u8]) -> Result<Digest> {
    let text = std::str::from_utf8(bytes).map_err(|_| StoreError::InvalidDigest {
        text: format!("tag {tag}"),
        reason: "tag file is not UTF-8",
    })?;
    Digest::parse(text.trim())
}

#[derive(Debug, Clone)]
pub struct LocalCache {
    root: PathBuf,
}

impl LocalCache {
    /// Opens (creating if needed) a cache rooted at `root`, and removes what
    /// interrupted writers left in `tmp/` when no other operation is running.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        for d in [CHUNKS_DIR, LAYERS_DIR, TAGS_DIR, IMAGES_DIR, TMP_DIR] {
            fsutil::create_dir_all(&root.join(d))?;
        }
        let cache = LocalCache { root };
        cache.open_lock_file()?;
        // Leftovers only cost space; a cache that cannot be swept still works.
        match cache.sweep_temp() {
            Ok(Some(n)) if n > 0 => {
                let root = cache.root.display();
                tracing::info!(removed = n, %root, "swept leftover temp files");
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(%e, "could not sweep the cache's tmp/"),
        }
        Ok(cache)
    }

    fn open_lock_file(&self) -> Result<File> {
        let path = self.root.join(LOCK_FILE);
        fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(StoreError::io("open cache lock", &path))
    }

    fn lock(&self, op: libc::c_int) -> Result<Option<CacheLock>> {
        let file = self.open_lock_file()?;
        loop {
            // SAFETY: flock on a descriptor we own; no memory is passed.
            if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
                return Ok(Some(CacheLock { file }));
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                ErrorKind::Interrupted => continue,
                ErrorKind::WouldBlock => return Ok(None),
                _ => return Err(StoreError::io("lock cache", self.root.join(LOCK_FILE))(e)),
            }
        }
    }

    /// Held by every writer for the whole of its operation (see module docs).
    /// Blocks while an eviction runs.
    pub(crate) fn lock_shared(&self) -> Result<CacheLock> {
        Ok(self.lock(libc::LOCK_SH)?.expect("blocking flock"))
    }

    fn lock_exclusive(&self) -> Result<CacheLock> {
        Ok(self.lock(libc::LOCK_EX)?.expect("blocking flock"))
    }

    /// Removes everything in `tmp/` (temp files and import staging left by
    /// killed or crashed writers). Returns how many entries went, or None
    /// when another operation holds the cache: its temp files are live.
    pub fn sweep_temp(&self) -> Result<Option<u64>> {
        match self.lock(libc::LOCK_EX | libc::LOCK_NB)? {
            Some(_lock) => self.sweep_temp_locked().map(Some),
            None => Ok(None),
        }
    }

    fn sweep_temp_locked(&self) -> Result<u64> {
        let dir = self.tmp_dir();
        let mut removed = 0;
        for entry in fs::read_dir(&dir).map_err(StoreError::io("list temp files", &dir))? {
            let entry = entry.map_err(StoreError::io("list temp files", &dir))?;
            let path = entry.path();
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            let r = if is_dir {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            match r {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => return Err(StoreError::io("remove temp file", path)(e)),
            }
        }
        Ok(removed)
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join(TMP_DIR)
    }

    pub fn object_path(&self, d: &Digest) -> PathBuf {
        self.root.join(object_key(d))
    }

    pub fn layer_path(&self, d: &Digest) -> PathBuf {
        self.root.join(layer_key(d))
    }

    pub fn image_path(&self, head: &Digest) -> PathBuf {
        self.root
            .join(IMAGES_DIR)
            .join(format!("{}.mem", head.hex()))
    }

    pub fn has_object(&self, d: &Digest) -> bool {
        self.object_path(d).is_file()
    }

    pub fn has_layer(&self, d: &Digest) -> bool {
        self.layer_path(d).is_file()
    }

    /// Stores an object after checking it hashes to `d` (the ingest check).
    /// Atomic and durable: temp file, fsync, rename, fsync of the directory.
    pub fn put_object_verified(&self, d: &Digest, bytes: &[u8]) -> Result<()> {
        let actual = Digest::of(bytes);
        if actual != *d {
            return Err(StoreError::CorruptObject {
                digest: *d,
                reason: format!("content hashes to {actual}"),
            });
        }
        self.put_object_trusted(d, bytes)
    }

    /// Stores an object whose hash the caller computed from these very bytes.
    pub(crate) fn put_object_trusted(&self, d: &Digest, bytes: &[u8]) -> Result<()> {
        let path = self.object_path(d);
        if path.is_file() {
            return Ok(()); // content addressed: same name, same bytes
        }
        let _lock = self.lock_shared()?;
        fsutil::write_atomic(&self.tmp_dir(), &path, bytes)
    }

    /// Writes an object to a temp file without syncing; None if already
    /// cached. Publish the batch with [`LocalCache::publish_staged`].
    pub(crate) fn stage_object(
        &self,
        d: &Digest,
        bytes: &[u8],
    ) -> Result<Option<(Digest, PathBuf)>> {
        if self.object_path(d).is_file() {
            return Ok(None);
        }
        let tmp = fsutil::temp_path(&self.tmp_dir(), "object");
        fs::write(&tmp, bytes).map_err(StoreError::io("write temp object", &tmp))?;
        Ok(Some((*d, tmp)))
    }

    /// Makes staged objects durable, then renames them into place, then makes
    /// the renames durable: a crash never leaves a torn file under an object
    /// name. (syncfs would be one call, but on a shared filesystem it also
    /// flushes everyone else's writes and measured slower.)
    pub(crate) fn publish_staged(&self, staged: &[(Digest, PathBuf)]) -> Result<()> {
        for (_, tmp) in staged {
            fs::File::open(tmp)
                .and_then(|f| f.sync_all())
                .map_err(StoreError::io("fsync temp object", tmp))?;
        }
        let mut dirs = std::collections::BTreeSet::new();
        for (d, tmp) in staged {
            let dest = self.object_path(d);
            if dest.is_file() {
                let _ = fs::remove_file(tmp);
                continue;
            }
            let parent = dest.parent().expect("object paths have a parent");
            fsutil::create_dir_all(parent)?;
            fs::rename(tmp, &dest).map_err(StoreError::io("rename object into place", &dest))?;
            dirs.insert(parent.to_path_buf());
        }
        for dir in &dirs {
            fsutil::fsync_dir(dir)?;
        }
        if !dirs.is_empty() {
            fsutil::fsync_dir(&self.root.join(CHUNKS_DIR))?;
        }
        Ok(())
    }

    /// Reads an object's stored (compressed) bytes; no re-verification.
    pub fn read_object(&self, d: &Digest) -> Result<Vec<u8>> {
        let path = self.object_path(d);
        fs::read(&path).map_err(|e| match e.kind() {
            ErrorKind::NotFound => StoreError::ObjectNotCached(*d),
            _ => StoreError::Io {
                context: "read object",
                path,
                source: e,
            },
        })
    }

    /// Reads and decompresses an object, checking the decompressed length.
    pub fn read_object_raw(&self, r: &pb::ObjectRef) -> Result<Vec<u8>> {
        let d = Digest::from_bytes(&r.hash)?;
        let stored = self.read_object(&d)?;
        decompress_exact(&d, &stored, r.raw_len)
    }

    /// Stores a validated layer manifest (atomically; idempotent).
    pub fn put_layer(&self, layer: &Layer) -> Result<()> {
        let path = self.layer_path(&layer.digest);
        if path.is_file() {
            return Ok(());
        }
        let _lock = self.lock_shared()?;
        fsutil::write_atomic(&self.tmp_dir(), &path, &layer.bytes)
    }

    /// Reads a manifest. Manifests are a few KiB, so they are re-hashed on
    /// read: cheap, and it keeps a damaged file from steering assembly.
    pub fn read_layer(&self, d: &Digest) -> Result<Layer> {
        let path = self.layer_path(d);
        let bytes = fs::read(&path).map_err(|e| match e.kind() {
            ErrorKind::NotFound => StoreError::LayerNotCached(*d),
            _ => StoreError::Io {
                context: "read layer manifest",
                path,
                source: e,
            },
        })?;
        Layer::decode_verified(*d, bytes)
    }

    /// The chain from `head` down to its base layer, head first.
    pub fn chain(&self, head: &Digest) -> Result<Vec<Layer>> {
        let mut chain = vec![self.read_layer(head)?];
        while let Some(parent) = chain.last().and_then(Layer::parent) {
            let layer = self.read_layer(&parent)?;
            check_link(chain.last().expect("non-empty"), &layer)?;
            chain.push(layer);
        }
        Ok(chain)
    }

    pub fn list_layers(&self) -> Result<Vec<Digest>> {
        let dir = self.root.join(LAYERS_DIR);
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(StoreError::io("list layers", &dir))? {
            let entry = entry.map_err(StoreError::io("list layers", &dir))?;
            if let Some(d) = entry
                .file_name()
                .to_str()
                .and_then(|n| Digest::parse(n).ok())
            {
                out.push(d);
            }
        }
        out.sort();
        Ok(out)
    }

    pub fn set_tag(&self, tag: &str, head: &Digest) -> Result<()> {
        validate_tag(tag)?;
        let path = self.root.join(tag_key(tag));
        let _lock = self.lock_shared()?;
        fsutil::write_atomic(
            &self.tmp_dir(),
            &path,
            format!("{}\n", head.hex()).as_bytes(),
        )
    }

    pub fn get_tag(&self, tag: &str) -> Result<Digest> {
        validate_tag(tag)?;
        let path = self.root.join(tag_key(tag));
        match fs::read(&path) {
            Ok(bytes) => parse_tag_value(tag, &bytes),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Err(StoreError::UnknownTag(tag.to_string()))
            }
            Err(e) => Err(StoreError::Io {
                context: "read tag",
                path,
                source: e,
            }),
        }
    }

    pub fn remove_tag(&self, tag: &str) -> Result<()> {
        validate_tag(tag)?;
        let path = self.root.join(tag_key(tag));
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                Err(StoreError::UnknownTag(tag.to_string()))
            }
            Err(e) => Err(StoreError::Io {
                context: "remove tag",
                path,
                source: e,
            }),
        }
    }

    /// All (tag, head) pairs, sorted by tag. Unparsable entries are skipped.
    pub fn list_tags(&self) -> Result<Vec<(String, Digest)>> {
        let dir = self.root.join(TAGS_DIR);
        let mut out = Vec::new();
        for entry in fs::read_dir(&dir).map_err(StoreError::io("list tags", &dir))? {
            let entry = entry.map_err(StoreError::io("list tags", &dir))?;
            let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
                continue;
            };
            if validate_tag(&name).is_err() {
                continue;
            }
            if let Ok(d) = self.get_tag(&name) {
                out.push((name, d));
            }
        }
        out.sort();
        Ok(out)
    }

    /// Resolves a tag or a digest to a head digest known to this cache.
    pub fn resolve(&self, tag_or_digest: &str) -> Result<Digest> {
        match Digest::parse(tag_or_digest) {
            Ok(d) => Ok(d),
            Err(_) => self.get_tag(tag_or_digest),
        }
    }

    /// Disk space the cache occupies, by kind. Counts allocated blocks, not
    /// lengths: an assembled image is sparse and may be mostly holes.
    pub fn usage(&self) -> Result<CacheUsage> {
        let mut u = CacheUsage::default();
        for (dir, slot) in [
            (CHUNKS_DIR, &mut u.chunks),
            (LAYERS_DIR, &mut u.layers),
            (IMAGES_DIR, &mut u.images),
            (TMP_DIR, &mut u.tmp),
        ] {
            walk_files(&self.root.join(dir), &mut |_, meta| {
                *slot += disk_bytes(meta)
            })?;
        }
        Ok(u)
    }

    /// Shrinks the cache to at most `max_bytes` ([`CacheUsage::total`]) by
    /// removing, in this order and only until the bound is met:
    ///
    /// 1. debris: objects no manifest names, images of heads that are gone;
    /// 2. assembled images of heads not in use, least recently used first
    ///    (mtime: set when assembled, refreshed by every [`assemble`] that
    ///    returns an existing image);
    /// 3. layers no in-use chain needs, leaves first (a remaining layer always
    ///    keeps its parent), least recently used first, each with the objects
    ///    that no remaining layer references. A layer counts as used when it
    ///    or any layer on top of it was pulled, built or assembled (manifest
    ///    mtime, which [`assemble`] refreshes too).
    ///
    /// `in_use(head)` is asked about every cached layer and image; the chain
    /// of a head it accepts, everything the chain references and the head's
    /// image are never removed, even when that leaves the cache over the
    /// bound ([`EvictReport::within_bound`]). It must also accept heads that
    /// exist nowhere else (built here, not yet pushed), and must not call
    /// into this cache: the cache is locked exclusively while it runs, which
    /// also waits for pulls, builds and imports in progress to finish.
    ///
    /// [`assemble`]: crate::assemble::assemble
    pub fn evict_to(
        &self,
        max_bytes: u64,
        in_use: &dyn Fn(&Digest) -> bool,
    ) -> Result<EvictReport> {
        let _lock = self.lock_exclusive()?;
        let temp_removed = self.sweep_temp_locked()?;
        let before = self.usage()?;
        let mut report = EvictReport {
            max_bytes,
            before,
            after: before,
            temp_files_removed: temp_removed,
            ..Default::default()
        };
        let mut total = before.total();
        if total <= max_bytes {
            return Ok(report);
        }
        let mut inv = Inventory::read(self)?;

        // Protection: the whole chain of every in-use head.
        let mut protected = HashSet::new();
        for d in inv.layers.keys() {
            if in_use(d) {
                let mut next = Some(*d);
                while let Some(l) = next.filter(|l| protected.insert(*l)) {
                    next = inv.layers.get(&l).and_then(Layer::parent);
                }
            }
        }
        report.layers_in_use = protected
            .iter()
            .filter(|d| inv.layers.contains_key(d))
            .count() as u64;

        // 1. Debris. No writer is running (we hold the lock exclusively), so
        // an object nobody names is left over from a crash, not in transit.
        for (d, path) in std::mem::take(&mut inv.orphans) {
            if total <= max_bytes {
                break;
            }
            total = total.saturating_sub(remove_counted(&path)?);
            report.objects_removed += 1;
            tracing::debug!(object = %d, "evicted unreferenced object");
        }
        let (stale, mut images): (Vec<_>, Vec<_>) = std::mem::take(&mut inv.images)
            .into_iter()
            .filter(|i| !in_use(&i.head))
            .partition(|i| !inv.layers.contains_key(&i.head) && !inv.corrupt.contains(&i.head));
        // 2. Images, least recently used first.
        images.sort_by_key(|i| (i.used, i.head));
        for img in stale.into_iter().chain(images) {
            if total <= max_bytes {
                break;
            }
            total = total.saturating_sub(remove_counted(&img.path)?);
            report.removed_images.push(img.head);
        }

        // 3. Layers, leaves first, least recently used chain first. A layer's
        // recency is the latest use of anything built on it.
        let mut used: HashMap<Digest, SystemTime> = HashMap::new();
        for (d, l) in &inv.layers {
            let own = inv.manifest_used[d].max(
                inv.image_used
                    .get(d)
                    .copied()
                    .unwrap_or(SystemTime::UNIX_EPOCH),
            );
            let mut next = Some((*d, l));
            while let Some((a, layer)) = next {
                let e = used.entry(a).or_insert(own);
                *e = (*e).max(own);
                next = layer
                    .parent()
                    .and_then(|p| inv.layers.get(&p).map(|pl| (p, pl)));
            }
        }
        let mut children: HashMap<Digest, u32> = HashMap::new();
        for l in inv.layers.values() {
            if let Some(p) = l.parent().filter(|p| inv.layers.contains_key(p)) {
                *children.entry(p).or_default() += 1;
            }
        }
        while total > max_bytes {
            let victim = inv
                .layers
                .keys()
                .filter(|d| !protected.contains(*d) && children.get(*d).copied().unwrap_or(0) == 0)
                .min_by_key(|d| (used[*d], **d))
                .copied();
            let Some(victim) = victim else {
                break; // only in-use chains remain
            };
            let layer = inv.layers.remove(&victim).expect("listed");
            if let Some(p) = layer.parent() {
                if let Some(n) = children.get_mut(&p) {
                    *n -= 1;
                }
            }
            let (freed, objects) = self.remove_layer(&layer, &mut inv.refs)?;
            total = total.saturating_sub(freed);
            report.objects_removed += objects;
            report.removed_layers.push(victim);
        }
        report.after = self.usage()?;
        tracing::info!(
            max_bytes,
            before = before.total(),
            after = report.after.total(),
            images = report.removed_images.len(),
            layers = report.removed_layers.len(),
            objects = report.objects_removed,
            "cache evicted"
        );
        Ok(report)
    }

    /// Removes one layer and the objects no remaining layer references.
    ///
    /// Order: image, manifest (made durable by an fsync of `layers/`), then
    /// objects. A crash at any point leaves every remaining manifest with all
    /// its objects; at worst objects (or an image) that nothing names, which
    /// the next eviction removes as debris. Objects first could leave a
    /// manifest promising objects that are gone, found only mid-assembly.
    fn remove_layer(&self, layer: &Layer, refs: &mut HashMap<Digest, u32>) -> Result<(u64, u64)> {
        let mut freed = 0;
        let image = self.image_path(&layer.digest);
        if image.exists() {
            freed += remove_counted(&image)?;
        }
        freed += remove_counted(&self.layer_path(&layer.digest))?;
        fsutil::fsync_dir(&self.root.join(LAYERS_DIR))?;
        let mut objects = 0;
        for d in layer_objects(layer)? {
            let n = refs.get_mut(&d).expect("counted when listed");
            *n -= 1;
            if *n == 0 {
                refs.remove(&d);
                let path = self.object_path(&d);
                if path.exists() {
                    freed += remove_counted(&path)?;
                    objects += 1;
                }
            }
        }
        tracing::debug!(layer = %layer.digest, objects, "evicted layer");
        Ok((freed, objects))
    }
}

/// A held [`LocalCache`] lock; released when dropped.
#[derive(Debug)]
pub(crate) struct CacheLock {
    file: File,
}

impl Drop for CacheLock {
    /// Unlock explicitly: closing alone leaves the lock held while a child forked by another
    /// thread (a VMM worker being spawned) still shares the open file before its exec.
    fn drop(&mut self) {
        // SAFETY: flock on a descriptor we own.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// Bytes on disk (allocated blocks) per part of the cache.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheUsage {
    pub chunks: u64,
    pub layers: u64,
    pub images: u64,
    /// In-flight writes (and leftovers of interrupted ones); not in
    /// [`CacheUsage::total`], as eviction cannot remove live temp files.
    pub tmp: u64,
}

impl CacheUsage {
    /// What [`LocalCache::evict_to`] bounds: chunks, layers and images.
    pub fn total(&self) -> u64 {
        self.chunks + self.layers + self.images
    }
}

/// What [`LocalCache::evict_to`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EvictReport {
    pub max_bytes: u64,
    pub before: CacheUsage,
    pub after: CacheUsage,
    /// Heads whose images were removed, in removal order.
    pub removed_images: Vec<Digest>,
    /// Layers removed, in removal order (children before parents).
    pub removed_layers: Vec<Digest>,
    pub objects_removed: u64,
    pub temp_files_removed: u64,
    /// Cached layers kept because an in-use head's chain needs them.
    pub layers_in_use: u64,
}

impl EvictReport {
    /// False when in-use chains alone exceed the bound.
    pub fn within_bound(&self) -> bool {
        self.after.total() <= self.max_bytes
    }
}

struct ImageFile {
    head: Digest,
    path: PathBuf,
    used: SystemTime,
}

/// What eviction works from, read once under the exclusive lock.
struct Inventory {
    layers: HashMap<Digest, Layer>,
    /// Manifests that fail verification: kept (not ours to judge here), but
    /// their references are unknown, so they protect nothing.
    corrupt: HashSet<Digest>,
    manifest_used: HashMap<Digest, SystemTime>,
    image_used: HashMap<Digest, SystemTime>,
    /// How many readable layers reference each object.
    refs: HashMap<Digest, u32>,
    orphans: Vec<(Digest, PathBuf)>,
    images: Vec<ImageFile>,
}

impl Inventory {
    fn read(cache: &LocalCache) -> Result<Self> {
        let mut inv = Inventory {
            layers: HashMap::new(),
            corrupt: HashSet::new(),
            manifest_used: HashMap::new(),
            image_used: HashMap::new(),
            refs: HashMap::new(),
            orphans: Vec::new(),
            images: Vec::new(),
        };
        for d in cache.list_layers()? {
            let path = cache.layer_path(&d);
            let meta = fs::metadata(&path).map_err(StoreError::io("stat layer manifest", &path))?;
            // An unreadable manifest aborts: its objects' liveness is unknown.
            match cache.read_layer(&d) {
                Ok(l) => {
                    for o in layer_objects(&l)? {
                        *inv.refs.entry(o).or_default() += 1;
                    }
                    inv.manifest_used.insert(d, modified(&meta));
                    inv.layers.insert(d, l);
                }
                Err(StoreError::CorruptLayer { .. }) => {
                    inv.corrupt.insert(d);
                }
                Err(e) => return Err(e),
            }
        }
        walk_files(&cache.root.join(CHUNKS_DIR), &mut |path, _| {
            let d = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| Digest::parse(n).ok());
            if let Some(d) = d.filter(|d| !inv.refs.contains_key(d)) {
                inv.orphans.push((d, path.to_path_buf()));
            }
        })?;
        inv.orphans.sort();
        let dir = cache.root.join(IMAGES_DIR);
        for entry in fs::read_dir(&dir).map_err(StoreError::io("list images", &dir))? {
            let entry = entry.map_err(StoreError::io("list images", &dir))?;
            let name = entry.file_name();
            let Some(head) = name
                .to_str()
                .and_then(|n| n.strip_suffix(".mem"))
                .and_then(|h| Digest::parse(h).ok())
            else {
                continue;
            };
            let meta = entry
                .metadata()
                .map_err(StoreError::io("stat image", entry.path()))?;
            inv.image_used.insert(head, modified(&meta));
            inv.images.push(ImageFile {
                head,
                path: entry.path(),
                used: modified(&meta),
            });
        }
        Ok(inv)
    }
}

/// A layer's distinct objects.
fn layer_objects(l: &Layer) -> Result<BTreeSet<Digest>> {
    l.object_refs()
        .map(|o| Digest::from_bytes(&o.hash))
        .collect()
}

fn modified(meta: &fs::Metadata) -> SystemTime {
    meta.modified().unwrap_or(SystemTime::UNIX_EPOCH)
}

fn disk_bytes(meta: &fs::Metadata) -> u64 {
    meta.blocks() * 512
}

/// Removes a file, returning the disk space it held.
fn remove_counted(path: &Path) -> Result<u64> {
    let bytes = match fs::metadata(path) {
        Ok(m) => disk_bytes(&m),
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(StoreError::io("stat", path)(e)),
    };
    match fs::remove_file(path) {
        Ok(()) => Ok(bytes),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(0),
        Err(e) => Err(StoreError::io("remove", path)(e)),
    }
}

/// Calls `f` for every regular file under `dir` (recursively).
fn walk_files(dir: &Path, f: &mut dyn FnMut(&Path, &fs::Metadata)) -> Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StoreError::io("list directory", dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(StoreError::io("list directory", dir))?;
        let path = entry.path();
        // symlink_metadata: never follow a link out of the cache.
        let meta = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == ErrorKind::NotFound => continue, // raced a removal
            Err(e) => return Err(StoreError::io("stat", &path)(e)),
        };
        if meta.is_dir() {
            walk_files(&path, f)?;
        } else if meta.is_file() {
            f(&path, &meta);
        }
    }
    Ok(())
}

/// A child must agree with its parent on geometry and depth.
pub(crate) fn check_link(child: &Layer, parent: &Layer) -> Result<()> {
    let (c, p) = (&child.manifest, &parent.manifest);
    if c.memory_size != p.memory_size || c.page_size != p.page_size || c.depth != p.depth + 1 {
        return Err(StoreError::CorruptLayer {
            digest: child.digest,
            reason: format!(
                "does not fit parent {} (memory {} vs {}, page size {} vs {}, depth {} vs {})",
                parent.digest,
                c.memory_size,
                p.memory_size,
                c.page_size,
                p.page_size,
                c.depth,
                p.depth
            ),
        });
    }
    Ok(())
}

/// Decompresses `stored`, refusing output that is not exactly `raw_len` bytes.
pub fn decompress_exact(d: &Digest, stored: &[u8], raw_len: u64) -> Result<Vec<u8>> {
    let corrupt = |reason: String| StoreError::CorruptObject { digest: *d, reason };
    let cap = usize::try_from(raw_len).map_err(|_| corrupt("raw length overflows".into()))?;
    // bulk::decompress caps output at `cap`, so a hostile object cannot balloon.
    let raw = zstd::bulk::decompress(stored, cap).map_err(|e| corrupt(format!("zstd: {e}")))?;
    if raw.len() != cap {
        return Err(corrupt(format!(
            "decompressed to {} bytes, expected {raw_len}",
            raw.len()
        )));
    }
    Ok(raw)
}
