//! Layer manifests: the protobuf `tine.store.v1.LayerManifest` plus the rules
//! that make a decoded manifest safe to act on (bounds, ordering, totals).
//! Validation happens once, when a manifest enters the cache or a pack import.

use prost::Message;

use crate::digest::Digest;
use crate::error::{Result, StoreError};
pub use tine_proto::store::v1 as pb;

pub const FORMAT_VERSION: u32 = 1;
/// Manifests above this size are refused before decoding (hostile input).
pub const MAX_MANIFEST_BYTES: usize = 64 << 20;
/// Upper bound on one chunk's decompressed size (builder uses ≤ 5 MiB).
pub const MAX_CHUNK_RAW_BYTES: u64 = 64 << 20;
/// Upper bound on the VMM state blob.
pub const MAX_STATE_RAW_BYTES: u64 = 1 << 30;
/// Upper bound on guest memory (16 TiB, the most a sandbox may be given), keeps page
/// arithmetic far from overflow.
pub const MAX_MEMORY_BYTES: u64 = 1 << 44;

/// Where a page's contents come from, as seen by one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageSource {
    /// Stored in chunk `chunk` at page offset `chunk_page`.
    Stored { chunk: usize, chunk_page: u64 },
    /// Explicitly zero in this layer.
    Zero,
    /// Not mentioned: ask the parent (zero for a base layer).
    Inherited,
}

/// A decoded, verified, validated layer manifest and its digest.
#[derive(Debug, Clone)]
pub struct Layer {
    pub digest: Digest,
    pub manifest: pb::LayerManifest,
    /// Exact encoded bytes; the digest is their hash.
    pub bytes: Vec<u8>,
}

impl Layer {
    /// Encodes and validates a manifest built locally.
    pub fn from_manifest(manifest: pb::LayerManifest) -> Result<Self> {
        let bytes = manifest.encode_to_vec();
        let digest = Digest::of(&bytes);
        let layer = Layer {
            digest,
            manifest,
            bytes,
        };
        layer.validate()?;
        Ok(layer)
    }

    /// Checks `bytes` hash to `expected`, then decodes and validates.
    pub fn decode_verified(expected: Digest, bytes: Vec<u8>) -> Result<Self> {
        let corrupt = |reason: String| StoreError::CorruptLayer {
            digest: expected,
            reason,
        };
        if bytes.len() > MAX_MANIFEST_BYTES {
            return Err(corrupt(format!(
                "manifest is {} bytes, limit {MAX_MANIFEST_BYTES}",
                bytes.len()
            )));
        }
        let actual = Digest::of(&bytes);
        if actual != expected {
            return Err(corrupt(format!("manifest hashes to {actual}")));
        }
        let manifest = pb::LayerManifest::decode(bytes.as_slice())
            .map_err(|e| corrupt(format!("manifest does not decode: {e}")))?;
        let layer = Layer {
            digest: expected,
            manifest,
            bytes,
        };
        layer.validate()?;
        Ok(layer)
    }

    pub fn parent(&self) -> Option<Digest> {
        if self.manifest.parent.is_empty() {
            None
        } else {
            // validate() guarantees 32 bytes.
            Digest::from_bytes(&self.manifest.parent).ok()
        }
    }

    pub fn page_size(&self) -> u64 {
        u64::from(self.manifest.page_size)
    }

    pub fn page_count(&self) -> u64 {
        self.manifest.memory_size / self.page_size()
    }

    pub fn chunk_digest(&self, chunk: usize) -> Digest {
        Digest::from_bytes(&self.manifest.chunks[chunk].hash).expect("validated")
    }

    pub fn state_ref(&self) -> &pb::ObjectRef {
        self.manifest.state.as_ref().expect("validated")
    }

    /// Every object (chunks and state) this layer references.
    pub fn object_refs(&self) -> impl Iterator<Item = &pb::ObjectRef> {
        self.manifest
            .chunks
            .iter()
            .chain(self.manifest.state.as_ref())
    }

    pub fn totals(&self) -> pb::LayerTotals {
        self.manifest.totals.unwrap_or_default()
    }

    /// Bytes this layer adds to a store: chunks plus state, compressed.
    pub fn stored_bytes(&self) -> u64 {
        self.object_refs().map(|o| o.stored_len).sum()
    }

    pub fn lookup(&self, page: u64) -> PageSource {
        let runs = &self.manifest.pages;
        let i = runs.partition_point(|r| r.first_page <= page);
        if i > 0 {
            let r = &runs[i - 1];
            if page < r.first_page + r.page_count {
                return PageSource::Stored {
                    chunk: r.chunk as usize,
                    chunk_page: r.chunk_page + (page - r.first_page),
                };
            }
        }
        let zeros = &self.manifest.zeroed;
        let i = zeros.partition_point(|s| s.first_page <= page);
        if i > 0 {
            let s = &zeros[i - 1];
            if page < s.first_page + s.page_count {
                return PageSource::Zero;
            }
        }
        PageSource::Inherited
    }

    /// Structural validation; see the rules in manifest.proto.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| StoreError::CorruptLayer {
            digest: self.digest,
            reason,
        };
        let m = &self.manifest;
        if m.format_version != FORMAT_VERSION {
            return Err(bad(format!(
                "unsupported format version {}",
                m.format_version
            )));
        }
        if m.hash_algorithm != pb::HashAlgorithm::Blake3 as i32 {
            return Err(bad(format!(
                "unsupported hash algorithm {}",
                m.hash_algorithm
            )));
        }
        if m.compression != pb::Compression::Zstd as i32 {
            return Err(bad(format!("unsupported compression {}", m.compression)));
        }
        let ps = u64::from(m.page_size);
        if !ps.is_power_of_two() || !(512..=(1 << 30)).contains(&ps) {
            return Err(bad(format!("bad page size {ps}")));
        }
        if m.memory_size == 0
            || !m.memory_size.is_multiple_of(ps)
            || m.memory_size > MAX_MEMORY_BYTES
        {
            return Err(bad(format!("bad memory size {}", m.memory_size)));
        }
        let pages = m.memory_size / ps;
        match (m.parent.len(), m.depth) {
            (0, 0) => {}
            (32, d) if d > 0 => {}
            (len, d) => return Err(bad(format!("parent of {len} bytes with depth {d}"))),
        }
        if m.parent.is_empty() && !m.zeroed.is_empty() {
            return Err(bad("base layer lists zeroed pages".into()));
        }
        let check_obj = |o: &pb::ObjectRef, what: &str, max_raw: u64| -> Result<()> {
            if o.hash.len() != 32 {
                return Err(bad(format!("{what} hash is {} bytes", o.hash.len())));
            }
            if o.raw_len > max_raw || o.stored_len > o.raw_len.saturating_add(1 << 20) {
                return Err(bad(format!("{what} lengths out of range")));
            }
            Ok(())
        };
        let mut chunk_pages = Vec::with_capacity(m.chunks.len());
        for (i, c) in m.chunks.iter().enumerate() {
            check_obj(c, &format!("chunk {i}"), MAX_CHUNK_RAW_BYTES)?;
            if c.raw_len == 0 || !c.raw_len.is_multiple_of(ps) {
                return Err(bad(format!(
                    "chunk {i} raw length {} is not whole pages",
                    c.raw_len
                )));
            }
            chunk_pages.push(c.raw_len / ps);
        }
        let state = m
            .state
            .as_ref()
            .ok_or_else(|| bad("missing state blob".into()))?;
        check_obj(state, "state blob", MAX_STATE_RAW_BYTES)?;

        let mut next_free = 0u64;
        let mut stored_pages = 0u64;
        for r in &m.pages {
            let end = r
                .first_page
                .checked_add(r.page_count)
                .filter(|&e| e <= pages);
            let Some(end) = end else {
                return Err(bad(format!(
                    "page run at {} runs past the end of memory",
                    r.first_page
                )));
            };
            if r.page_count == 0 || r.first_page < next_free {
                return Err(bad(format!(
                    "page runs unsorted or overlapping at page {}",
                    r.first_page
                )));
            }
            let cp = chunk_pages.get(r.chunk as usize).ok_or_else(|| {
                bad(format!(
                    "page run names chunk {} of {}",
                    r.chunk,
                    m.chunks.len()
                ))
            })?;
            if r.chunk_page
                .checked_add(r.page_count)
                .is_none_or(|e| e > *cp)
            {
                return Err(bad(format!(
                    "page run at {} overflows chunk {}",
                    r.first_page, r.chunk
                )));
            }
            next_free = end;
            stored_pages += r.page_count;
        }
        let mut next_free = 0u64;
        let mut zeroed_pages = 0u64;
        for s in &m.zeroed {
            let end = s
                .first_page
                .checked_add(s.page_count)
                .filter(|&e| e <= pages);
            let Some(end) = end else {
                return Err(bad(format!(
                    "zero span at {} runs past the end of memory",
                    s.first_page
                )));
            };
            if s.page_count == 0 || s.first_page < next_free {
                return Err(bad(format!(
                    "zero spans unsorted or overlapping at page {}",
                    s.first_page
                )));
            }
            if self.overlaps_runs(s.first_page, end) {
                return Err(bad(format!(
                    "zero span at {} overlaps stored pages",
                    s.first_page
                )));
            }
            next_free = end;
            zeroed_pages += s.page_count;
        }
        if m.working_set.len() as u64 > pages {
            return Err(bad(format!(
                "working set of {} pages in a {pages}-page memory",
                m.working_set.len()
            )));
        }
        if let Some(p) = m.working_set.iter().find(|&&p| p >= pages) {
            return Err(bad(format!(
                "working set page {p} is past the end of memory"
            )));
        }
        let distinct: std::collections::HashSet<u64> = m.working_set.iter().copied().collect();
        if distinct.len() != m.working_set.len() {
            return Err(bad("working set lists a page twice".into()));
        }
        if m.working_set_chunks as usize > m.chunks.len() {
            return Err(bad(format!(
                "{} working-set chunks of {}",
                m.working_set_chunks,
                m.chunks.len()
            )));
        }
        let raw_bytes: u64 = m.chunks.iter().map(|c| c.raw_len).sum();
        let stored_bytes: u64 = m.chunks.iter().map(|c| c.stored_len).sum();
        let expect = pb::LayerTotals {
            stored_pages,
            zeroed_pages,
            raw_bytes,
            stored_bytes,
        };
        if m.totals != Some(expect) {
            return Err(bad(format!(
                "totals {:?} do not match contents {expect:?}",
                m.totals
            )));
        }
        Ok(())
    }

    fn overlaps_runs(&self, start: u64, end: u64) -> bool {
        let runs = &self.manifest.pages;
        let i = runs.partition_point(|r| r.first_page + r.page_count <= start);
        runs.get(i).is_some_and(|r| r.first_page < end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(seed: &[u8], raw_len: u64) -> pb::ObjectRef {
        pb::ObjectRef {
            hash: Digest::of(seed).as_bytes().to_vec(),
            stored_len: 10,
            raw_len,
        }
    }

    fn sample() -> pb::LayerManifest {
        pb::LayerManifest {
            format_version: FORMAT_VERSION,
            hash_algorithm: pb::HashAlgorithm::Blake3 as i32,
            compression: pb::Compression::Zstd as i32,
            parent: Digest::of(b"parent").as_bytes().to_vec(),
            depth: 1,
            memory_size: 64 * 4096,
            page_size: 4096,
            chunks: vec![obj(b"c0", 3 * 4096)],
            pages: vec![
                pb::PageRun {
                    first_page: 2,
                    page_count: 2,
                    chunk: 0,
                    chunk_page: 0,
                },
                pb::PageRun {
                    first_page: 10,
                    page_count: 1,
                    chunk: 0,
                    chunk_page: 2,
                },
            ],
            zeroed: vec![pb::PageSpan {
                first_page: 5,
                page_count: 3,
            }],
            state: Some(obj(b"state", 100)),
            totals: Some(pb::LayerTotals {
                stored_pages: 3,
                zeroed_pages: 3,
                raw_bytes: 3 * 4096,
                stored_bytes: 10,
            }),
            working_set: vec![],
            working_set_chunks: 0,
        }
    }

    #[test]
    fn lookup_resolves_runs_and_zero_spans() {
        let l = Layer::from_manifest(sample()).unwrap();
        assert_eq!(
            l.lookup(3),
            PageSource::Stored {
                chunk: 0,
                chunk_page: 1
            }
        );
        assert_eq!(
            l.lookup(10),
            PageSource::Stored {
                chunk: 0,
                chunk_page: 2
            }
        );
        assert_eq!(l.lookup(6), PageSource::Zero);
        assert_eq!(l.lookup(0), PageSource::Inherited);
        assert_eq!(l.lookup(63), PageSource::Inherited);
    }

    #[test]
    fn decode_verified_rejects_wrong_digest_and_bad_structure() {
        let l = Layer::from_manifest(sample()).unwrap();
        let err = Layer::decode_verified(Digest::of(b"other"), l.bytes.clone()).unwrap_err();
        assert!(err.to_string().contains("hashes to"), "{err}");

        let mut m = sample();
        m.zeroed[0].first_page = 3; // overlaps stored pages 2..4
        let err = Layer::from_manifest(m).unwrap_err();
        assert!(err.to_string().contains("overlaps stored pages"), "{err}");

        let mut m = sample();
        m.pages[1].first_page = 63;
        m.pages[1].page_count = 2;
        assert!(Layer::from_manifest(m)
            .unwrap_err()
            .to_string()
            .contains("past the end"));

        let mut m = sample();
        m.pages[1].chunk_page = 3;
        assert!(Layer::from_manifest(m)
            .unwrap_err()
            .to_string()
            .contains("overflows chunk"));

        let mut m = sample();
        m.totals.as_mut().unwrap().stored_pages = 99;
        assert!(Layer::from_manifest(m)
            .unwrap_err()
            .to_string()
            .contains("totals"));
    }
}
