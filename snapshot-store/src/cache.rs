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
//! ```
//!
//! Objects are verified exactly once, when they enter (put_object_verified or
//! because this process computed their hash); reads never re-hash them.

use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

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
    /// Opens (creating if needed) a cache rooted at `root`.
    pub fn open(root: impl Into<PathBuf>) -> Result<Self> {
        let root = root.into();
        for d in [CHUNKS_DIR, LAYERS_DIR, TAGS_DIR, IMAGES_DIR, TMP_DIR] {
            fsutil::create_dir_all(&root.join(d))?;
        }
        Ok(LocalCache { root })
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
