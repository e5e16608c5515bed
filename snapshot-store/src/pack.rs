//! Packs: one tar file carrying a chain (or several) for air-gapped hosts.
//!
//! Layout, in this order:
//! ```text
//! TINE-PACK-INDEX       tine.store.v1.PackIndex: every other member's path, size, hash; tags
//! TINE-PACK-SIGNATURE   optional: ed25519 public key (32 B) ‖ signature (64 B) over the index
//! layers/<hex>          manifests, base first
//! chunks/ab/<hex>       zstd objects
//! ```
//! The signature covers the index, and the index pins every member's hash, so
//! one signature covers the whole pack. Objects are already compressed, so the
//! tar is not compressed again.
//!
//! Import is hostile-input safe: only regular files with the exact names
//! above, each listed once in the index with the stated size and hash, are
//! accepted. Everything is streamed into a staging directory inside the cache
//! and moved into place only after the whole pack checked out; on any error
//! the staging directory is removed and the cache is as before.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Signer, SigningKey, Verifier, VerifyingKey};
use prost::Message;

use crate::cache::{layer_key, object_key, LocalCache, CHUNKS_DIR, LAYERS_DIR};
use crate::digest::{Digest, Hasher};
use crate::error::{Result, StoreError};
use crate::fsutil;
use crate::manifest::{pb, Layer, FORMAT_VERSION, MAX_MANIFEST_BYTES};
use crate::tag::validate_tag;

pub const INDEX_NAME: &str = "TINE-PACK-INDEX";
pub const SIGNATURE_NAME: &str = "TINE-PACK-SIGNATURE";
/// Domain separation: a pack signature can never be replayed as another kind.
const SIGNING_CONTEXT: &[u8] = b"tine pack index v1\n";
const MAX_INDEX_BYTES: u64 = 64 << 20;

#[derive(Debug, Clone, Default)]
pub struct PackSummary {
    pub layers: usize,
    pub objects: usize,
    /// Bytes of member contents (the pack file is slightly larger: tar headers).
    pub content_bytes: u64,
    /// Guest memory bytes the heads describe (sum over heads).
    pub logical_bytes: u64,
    pub tags: Vec<(String, Digest)>,
    /// Hex public key that signed the pack, when signed.
    pub signer: Option<String>,
}

/// What to export: heads, each optionally under a tag.
#[derive(Debug, Clone)]
pub struct PackHead {
    pub tag: Option<String>,
    pub head: Digest,
}

/// Writes a pack of the given heads' chains to `out`.
pub fn export_pack(
    cache: &LocalCache,
    heads: &[PackHead],
    signing_key: Option<&SigningKey>,
    out: impl Write,
) -> Result<PackSummary> {
    // Chains and their objects stay put while they are copied out.
    let _lock = cache.lock_shared()?;
    let mut layers: Vec<Layer> = Vec::new();
    let mut seen_layers = HashSet::new();
    let mut tags = Vec::new();
    let mut logical = 0;
    for h in heads {
        let chain = cache.chain(&h.head)?;
        logical += chain[0].manifest.memory_size;
        if let Some(tag) = &h.tag {
            validate_tag(tag)?;
            tags.push((tag.clone(), h.head));
        }
        // Base first, so an importer (or a reader of `tar t`) meets parents first.
        for layer in chain.into_iter().rev() {
            if seen_layers.insert(layer.digest) {
                layers.push(layer);
            }
        }
    }
    let mut entries = Vec::new();
    let mut sources: Vec<(String, PathBuf)> = Vec::new();
    for l in &layers {
        let key = layer_key(&l.digest);
        entries.push(pb::PackEntry {
            path: key.clone(),
            size: l.bytes.len() as u64,
            hash: l.digest.as_bytes().to_vec(),
        });
        sources.push((key, cache.layer_path(&l.digest)));
    }
    let mut seen_objects = HashSet::new();
    for l in &layers {
        for o in l.object_refs() {
            let d = Digest::from_bytes(&o.hash)?;
            if !seen_objects.insert(d) {
                continue;
            }
            let path = cache.object_path(&d);
            let size = std::fs::metadata(&path)
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => StoreError::ObjectNotCached(d),
                    _ => StoreError::Io {
                        context: "stat object",
                        path: path.clone(),
                        source: e,
                    },
                })?
                .len();
            let key = object_key(&d);
            entries.push(pb::PackEntry {
                path: key.clone(),
                size,
                hash: d.as_bytes().to_vec(),
            });
            sources.push((key, path));
        }
    }
    let index = pb::PackIndex {
        format_version: FORMAT_VERSION,
        hash_algorithm: pb::HashAlgorithm::Blake3 as i32,
        entries,
        tags: tags
            .iter()
            .map(|(n, d)| pb::PackTag {
                name: n.clone(),
                head: d.as_bytes().to_vec(),
            })
            .collect(),
    };
    let index_bytes = index.encode_to_vec();

    let mut builder = tar::Builder::new(out);
    let pack_io = |e: std::io::Error| StoreError::Io {
        context: "write pack",
        path: PathBuf::from("<pack>"),
        source: e,
    };
    append(
        &mut builder,
        INDEX_NAME,
        index_bytes.len() as u64,
        index_bytes.as_slice(),
    )
    .map_err(pack_io)?;
    let mut signer = None;
    if let Some(key) = signing_key {
        let sig = key.sign(&signed_message(&index_bytes));
        let mut member = key.verifying_key().to_bytes().to_vec();
        member.extend_from_slice(&sig.to_bytes());
        append(
            &mut builder,
            SIGNATURE_NAME,
            member.len() as u64,
            member.as_slice(),
        )
        .map_err(pack_io)?;
        signer = Some(hex::encode(key.verifying_key().to_bytes()));
    }
    let mut content_bytes = 0;
    for ((key, path), entry) in sources.iter().zip(&index.entries) {
        let file = File::open(path).map_err(StoreError::io("open for pack", path))?;
        append(&mut builder, key, entry.size, file).map_err(pack_io)?;
        content_bytes += entry.size;
    }
    builder
        .into_inner()
        .and_then(|mut w| w.flush())
        .map_err(pack_io)?;
    Ok(PackSummary {
        layers: layers.len(),
        objects: seen_objects.len(),
        content_bytes,
        logical_bytes: logical,
        tags,
        signer,
    })
}

/// [`export_pack`] to a file, published atomically (temp + fsync + rename).
pub fn export_pack_to_file(
    cache: &LocalCache,
    heads: &[PackHead],
    signing_key: Option<&SigningKey>,
    dest: &Path,
) -> Result<PackSummary> {
    let dir = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut summary = None;
    fsutil::write_atomic_with(dir, dest, |f| {
        let w = std::io::BufWriter::with_capacity(1 << 20, &mut *f);
        summary = Some(export_pack(cache, heads, signing_key, w).map_err(std::io::Error::other)?);
        Ok(())
    })?;
    Ok(summary.expect("set on success"))
}

fn append(
    builder: &mut tar::Builder<impl Write>,
    name: &str,
    size: u64,
    data: impl Read,
) -> std::io::Result<()> {
    let mut header = tar::Header::new_ustar();
    header.set_path(name)?;
    header.set_size(size);
    header.set_mode(0o644);
    header.set_mtime(0); // reproducible packs
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();
    builder.append(&header, data)
}

fn signed_message(index: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(SIGNING_CONTEXT.len() + index.len());
    m.extend_from_slice(SIGNING_CONTEXT);
    m.extend_from_slice(index);
    m
}

/// Import policy for signatures.
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// When set, the pack must carry a valid signature by this key.
    pub verify_key: Option<VerifyingKey>,
    /// Let a pack whose signature was not verified move a tag the cache already has to
    /// another snapshot (otherwise refused: an unverified pack may add, never re-point).
    pub replace_tags: bool,
}

/// Imports a pack into the cache (all or nothing; see module docs).
pub fn import_pack(
    cache: &LocalCache,
    input: impl Read,
    opts: &ImportOptions,
) -> Result<PackSummary> {
    // Staging lives in tmp/, which a sweep may clear unless we hold the lock.
    let _lock = cache.lock_shared()?;
    let staging = Staging::new(cache)?;
    let staged = read_pack(cache, &staging.dir, input, opts)?;
    if opts.verify_key.is_none() && !opts.replace_tags {
        for (tag, head) in &staged.tags {
            match cache.get_tag(tag) {
                Ok(now) if now != *head => {
                    return Err(refuse(format!(
                        "tag {tag:?} names {} here and {} in this unverified pack: give the signer's key (--verify) or --replace-tags to move it",
                        now.hex(),
                        head.hex()
                    )))
                }
                Ok(_) | Err(StoreError::UnknownTag(_)) => {}
                Err(e) => return Err(e),
            }
        }
    }
    commit(cache, &staged)?;
    Ok(staged.summary)
}

pub fn import_pack_file(
    cache: &LocalCache,
    path: &Path,
    opts: &ImportOptions,
) -> Result<PackSummary> {
    let f = File::open(path).map_err(StoreError::io("open pack", path))?;
    import_pack(cache, std::io::BufReader::with_capacity(1 << 20, f), opts)
}

fn refuse(msg: impl Into<String>) -> StoreError {
    StoreError::PackRefused(msg.into())
}

/// A staging directory under the cache's tmp/, removed on drop.
struct Staging {
    dir: PathBuf,
}

impl Staging {
    fn new(cache: &LocalCache) -> Result<Self> {
        let dir = fsutil::temp_path(&cache.tmp_dir(), "import");
        fsutil::create_dir_all(&dir)?;
        Ok(Staging { dir })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

enum MemberKind {
    Layer(Digest),
    Object(Digest),
}

/// Accepts exactly `layers/<hex>` and `chunks/<hex[..2]>/<hex>`.
fn classify(path: &str) -> Result<MemberKind> {
    let bad = |why: &str| refuse(format!("member {path:?}: {why}"));
    if path.starts_with('/') {
        return Err(bad("absolute paths are not allowed"));
    }
    if path
        .split(['/', '\\'])
        .any(|c| c == ".." || c == "." || c.is_empty())
    {
        return Err(bad(
            "path components '..', '.' and empty ones are not allowed",
        ));
    }
    let parts: Vec<&str> = path.split('/').collect();
    match parts.as_slice() {
        [LAYERS_DIR, hex] => Digest::parse(hex)
            .map(MemberKind::Layer)
            .map_err(|_| bad("not a layer digest")),
        [CHUNKS_DIR, fan, hex] if hex.len() == 64 && hex.starts_with(fan) && fan.len() == 2 => {
            Digest::parse(hex)
                .map(MemberKind::Object)
                .map_err(|_| bad("not an object digest"))
        }
        _ => Err(bad(
            "unexpected member (only layers/<digest> and chunks/xx/<digest> belong in a pack)",
        )),
    }
}

struct Staged {
    layers: Vec<Layer>,
    objects: Vec<(Digest, PathBuf)>,
    tags: Vec<(String, Digest)>,
    summary: PackSummary,
}

fn read_pack(
    cache: &LocalCache,
    staging: &Path,
    input: impl Read,
    opts: &ImportOptions,
) -> Result<Staged> {
    let truncated = |what: &str, e: std::io::Error| {
        refuse(format!("truncated or unreadable pack ({what}): {e}"))
    };
    let mut archive = tar::Archive::new(input);
    let mut members = archive.entries().map_err(|e| truncated("archive", e))?;

    // 1. The index.
    let mut first = match members.next() {
        Some(m) => m.map_err(|e| truncated("first member", e))?,
        None => return Err(refuse("empty file: not a Tine pack")),
    };
    if first.path_bytes().as_ref() != INDEX_NAME.as_bytes() {
        return Err(refuse(format!(
            "first member must be {INDEX_NAME}: not a Tine pack"
        )));
    }
    check_regular(&first, INDEX_NAME)?;
    if first.header().size().unwrap_or(u64::MAX) > MAX_INDEX_BYTES {
        return Err(refuse("index is implausibly large"));
    }
    let mut index_bytes = Vec::new();
    first
        .read_to_end(&mut index_bytes)
        .map_err(|e| truncated("index", e))?;
    drop(first);
    let index = pb::PackIndex::decode(index_bytes.as_slice())
        .map_err(|e| refuse(format!("index does not decode: {e}")))?;
    if index.format_version != FORMAT_VERSION
        || index.hash_algorithm != pb::HashAlgorithm::Blake3 as i32
    {
        return Err(refuse(format!(
            "unsupported pack format {} / hash {}",
            index.format_version, index.hash_algorithm
        )));
    }
    let mut expected: BTreeMap<String, (u64, Digest)> = BTreeMap::new();
    for e in &index.entries {
        classify(&e.path)?;
        let hash = Digest::from_bytes(&e.hash)
            .map_err(|_| refuse(format!("index entry {:?}: bad hash", e.path)))?;
        if expected.insert(e.path.clone(), (e.size, hash)).is_some() {
            return Err(refuse(format!("index lists {:?} twice", e.path)));
        }
    }

    // 2. The optional signature, checked before any content is trusted.
    let mut next = members.next();
    let mut signer = None;
    if let Some(Ok(m)) = &next {
        if m.path_bytes().as_ref() == SIGNATURE_NAME.as_bytes() {
            let mut m = next
                .take()
                .expect("some")
                .map_err(|e| truncated("signature", e))?;
            check_regular(&m, SIGNATURE_NAME)?;
            let mut sig = Vec::new();
            m.by_ref()
                .take(97)
                .read_to_end(&mut sig)
                .map_err(|e| truncated("signature", e))?;
            if sig.len() != 96 {
                return Err(StoreError::Signature(
                    "signature member is not 96 bytes".into(),
                ));
            }
            let key = VerifyingKey::from_bytes(sig[..32].try_into().expect("32"))
                .map_err(|e| StoreError::Signature(format!("bad signer key: {e}")))?;
            let signature = Signature::from_bytes(sig[32..].try_into().expect("64"));
            signer = Some((key, signature));
            next = members.next();
        }
    }
    if let Some(trusted) = &opts.verify_key {
        let Some((key, signature)) = &signer else {
            return Err(StoreError::Signature(
                "pack is not signed but a verification key was given".into(),
            ));
        };
        if key != trusted {
            return Err(StoreError::Signature(format!(
                "pack is signed by key {} which is not the trusted key {}",
                hex::encode(key.to_bytes()),
                hex::encode(trusted.to_bytes())
            )));
        }
        key.verify(&signed_message(&index_bytes), signature)
            .map_err(|_| {
                StoreError::Signature(
                    "signature does not match the pack index (tampered pack)".into(),
                )
            })?;
    }

    // 3. Members: stream each into staging while hashing.
    let mut seen = HashSet::new();
    let mut layers = Vec::new();
    let mut objects = Vec::new();
    let mut content_bytes = 0;
    let mut buf = vec![0u8; 1 << 20];
    while let Some(m) = next {
        let mut m = m.map_err(|e| truncated("member header", e))?;
        let path = String::from_utf8(m.path_bytes().into_owned())
            .map_err(|_| refuse("member path is not UTF-8"))?;
        check_regular(&m, &path)?;
        let kind = classify(&path)?;
        if !seen.insert(path.clone()) {
            return Err(refuse(format!("duplicate member {path:?}")));
        }
        let Some(&(size, hash)) = expected.get(&path) else {
            return Err(refuse(format!(
                "member {path:?} is not listed in the index"
            )));
        };
        let name_digest = match kind {
            MemberKind::Layer(d) | MemberKind::Object(d) => d,
        };
        if hash != name_digest || m.header().size().ok() != Some(size) {
            return Err(refuse(format!("member {path:?} disagrees with the index")));
        }
        let staged = staging.join(name_digest.hex());
        let mut out =
            File::create(&staged).map_err(StoreError::io("create staging file", &staged))?;
        let mut hasher = Hasher::new();
        let mut kept = Vec::new(); // manifests are small and parsed below
        let mut copied = 0u64;
        loop {
            let n = m.read(&mut buf).map_err(|e| truncated(&path, e))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(StoreError::io("write staging file", &staged))?;
            if matches!(kind, MemberKind::Layer(_)) && kept.len() < MAX_MANIFEST_BYTES {
                kept.extend_from_slice(&buf[..n]);
            }
            copied += n as u64;
        }
        if copied != size {
            return Err(refuse(format!(
                "truncated pack: member {path:?} has {copied} of {size} bytes"
            )));
        }
        let actual = hasher.finish();
        if actual != hash {
            return Err(refuse(format!(
                "member {path:?} is corrupt: content hashes to {actual}, index says {hash}"
            )));
        }
        // Made durable in commit(), after the whole pack checked out.
        content_bytes += size;
        match kind {
            MemberKind::Layer(d) => layers.push(Layer::decode_verified(d, kept)?),
            MemberKind::Object(d) => objects.push((d, staged)),
        }
        next = members.next();
    }
    let missing: Vec<&String> = expected.keys().filter(|p| !seen.contains(*p)).collect();
    if !missing.is_empty() {
        return Err(refuse(format!(
            "truncated pack: {} member(s) listed in the index are missing, first {:?}",
            missing.len(),
            missing[0]
        )));
    }

    // 4. Completeness: every reference resolves in the pack or the cache.
    let in_pack_objects: HashSet<Digest> = objects.iter().map(|(d, _)| *d).collect();
    let in_pack_layers: HashMap<Digest, &Layer> = layers.iter().map(|l| (l.digest, l)).collect();
    for l in &layers {
        for o in l.object_refs() {
            let d = Digest::from_bytes(&o.hash)?;
            if !in_pack_objects.contains(&d) && !cache.has_object(&d) {
                return Err(refuse(format!(
                    "layer {} needs object {d}, which is neither in the pack nor the cache",
                    l.digest
                )));
            }
        }
        if let Some(p) = l.parent() {
            match in_pack_layers.get(&p) {
                Some(parent) => crate::cache::check_link(l, parent)?,
                None if cache.has_layer(&p) => crate::cache::check_link(l, &cache.read_layer(&p)?)?,
                None => {
                    return Err(refuse(format!(
                        "layer {} needs parent {p}, which is neither in the pack nor the cache",
                        l.digest
                    )))
                }
            }
        }
    }
    let mut tags = Vec::new();
    for t in &index.tags {
        validate_tag(&t.name)?;
        let head = Digest::from_bytes(&t.head)
            .map_err(|_| refuse(format!("tag {:?}: bad digest", t.name)))?;
        if !in_pack_layers.contains_key(&head) && !cache.has_layer(&head) {
            return Err(refuse(format!(
                "tag {:?} names layer {head}, which is not in the pack",
                t.name
            )));
        }
        tags.push((t.name.clone(), head));
    }
    let logical = tags
        .iter()
        .filter_map(|(_, h)| in_pack_layers.get(h))
        .map(|l| l.manifest.memory_size)
        .sum();
    layers.sort_by_key(|l| l.manifest.depth);
    let summary = PackSummary {
        layers: layers.len(),
        objects: objects.len(),
        content_bytes,
        logical_bytes: logical,
        tags: tags.clone(),
        signer: signer.map(|(k, _)| hex::encode(k.to_bytes())),
    };
    Ok(Staged {
        layers,
        objects,
        tags,
        summary,
    })
}

fn check_regular<R: Read>(m: &tar::Entry<'_, R>, path: &str) -> Result<()> {
    let t = m.header().entry_type();
    if t != tar::EntryType::Regular {
        return Err(refuse(format!(
            "member {path:?} is a {t:?} entry; only regular files are allowed (links and special files could escape the target)"
        )));
    }
    Ok(())
}

/// Moves verified staged files into the cache: objects, then layers (parents
/// first), then tags, so a crash mid-way never leaves a name pointing at
/// something absent.
fn commit(cache: &LocalCache, staged: &Staged) -> Result<()> {
    cache.publish_staged(&staged.objects)?;
    for l in &staged.layers {
        cache.put_layer(l)?;
    }
    for (tag, head) in &staged.tags {
        cache.set_tag(tag, head)?;
    }
    Ok(())
}
