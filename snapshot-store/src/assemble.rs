//! Turning a chain into something a VMM can map.
//!
//! [`assemble`] writes the flat image of a head once into the cache
//! (`images/<head>.mem`, sparse: zero pages are holes) and returns its path on
//! every later call without reading a single chunk, so spawn cost does not
//! depend on chain depth. Layers are applied head first and the stretches of
//! pages already settled are recorded, so every page is written at most once and
//! a chunk whose pages are all overridden is never decompressed.
//!
//! [`PageReader`] answers "page P of head H" without a flat image, for the
//! lazy-restore path.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use crate::cache::LocalCache;
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::manifest::{Layer, PageSource};

/// Returns the flat image of `head`, assembling it first if needed. All
/// objects of the chain must already be in the cache (see `remote::pull`).
pub fn assemble(cache: &LocalCache, head: &Digest) -> Result<PathBuf> {
    let path = cache.image_path(head);
    if path.is_file() {
        mark_used(cache, head, &path);
        return Ok(path);
    }
    // Eviction must not take the chain's objects while they are read.
    let _lock = cache.lock_shared()?;
    let chain = cache.chain(head)?;
    let top = &chain[0];
    let page_size = top.page_size();
    crate::fsutil::write_atomic_with(&cache.tmp_dir(), &path, |file| {
        file.set_len(top.manifest.memory_size)?;
        write_chain(cache, &chain, file, page_size).map_err(std::io::Error::other)
    })?;
    tracing::debug!(%head, depth = chain.len() - 1, "image assembled");
    mark_used(cache, head, &path);
    Ok(path)
}

/// Recency for [`LocalCache::evict_to`]: the image's mtime orders images, the
/// head manifest's outlives the image and orders chains. A failure only
/// makes them look older.
fn mark_used(cache: &LocalCache, head: &Digest, image: &std::path::Path) {
    for p in [image.to_path_buf(), cache.layer_path(head)] {
        if let Err(e) = crate::fsutil::touch(&p) {
            tracing::debug!(%e, path = %p.display(), "could not mark as used");
        }
    }
}

fn write_chain(cache: &LocalCache, chain: &[Layer], file: &File, page_size: u64) -> Result<()> {
    let mut settled = Settled::default();
    let ps = page_size as usize;
    for layer in chain {
        let m = &layer.manifest;
        // Runs are sorted by page and chunks are filled in page order, so a
        // chunk's runs are adjacent: decompress lazily, keep one at a time.
        // Working-set chunks (the first few) hold pages from all over memory: keep them
        // decompressed for the whole layer, beside the one regular chunk in use.
        let ws_chunks = m.working_set_chunks;
        let mut loaded: std::collections::HashMap<u32, Vec<u8>> = Default::default();
        for run in &m.pages {
            let mut p = run.first_page;
            let end = run.first_page + run.page_count;
            while p < end {
                if let Some(settled_to) = settled.covering(p) {
                    p = settled_to.min(end);
                    continue;
                }
                // Contiguous unsettled stretch [p, q).
                let q = settled.next_start(p).map_or(end, |s| s.min(end));
                if !loaded.contains_key(&run.chunk) {
                    if run.chunk >= ws_chunks {
                        loaded.retain(|c, _| *c < ws_chunks);
                    }
                    let obj = &m.chunks[run.chunk as usize];
                    loaded.insert(run.chunk, cache.read_object_raw(obj)?);
                }
                let data = &loaded[&run.chunk];
                let from = (run.chunk_page + (p - run.first_page)) as usize * ps;
                let to = from + (q - p) as usize * ps;
                file.write_all_at(&data[from..to], p * page_size)
                    .map_err(StoreError::io(
                        "write image",
                        cache.image_path(&chain[0].digest),
                    ))?;
                settled.set_range(p, q);
                p = q;
            }
        }
        // Zeroed pages are holes already; settle them so parents cannot fill them.
        for span in &m.zeroed {
            settled.set_range(span.first_page, span.first_page + span.page_count);
        }
    }
    Ok(())
}

/// Page-granular reads of a chain without assembling it.
pub struct PageReader {
    cache: LocalCache,
    chain: Vec<Layer>,
    /// Most recently decompressed chunk: (layer index, chunk index, bytes).
    recent: Option<(usize, usize, Vec<u8>)>,
}

impl PageReader {
    pub fn open(cache: &LocalCache, head: &Digest) -> Result<Self> {
        Ok(PageReader {
            cache: cache.clone(),
            chain: cache.chain(head)?,
            recent: None,
        })
    }

    pub fn page_size(&self) -> u64 {
        self.chain[0].page_size()
    }

    pub fn page_count(&self) -> u64 {
        self.chain[0].page_count()
    }

    /// Which layer (0 = head) and where page `page` comes from; None = zero.
    pub fn locate(&self, page: u64) -> Option<(usize, usize, u64)> {
        for (li, layer) in self.chain.iter().enumerate() {
            match layer.lookup(page) {
                PageSource::Stored { chunk, chunk_page } => return Some((li, chunk, chunk_page)),
                PageSource::Zero => return None,
                PageSource::Inherited => {}
            }
        }
        None
    }

    /// Copies page `page` into `out` (exactly one page long).
    pub fn read_page(&mut self, page: u64, out: &mut [u8]) -> Result<()> {
        let ps = self.page_size();
        if page >= self.page_count() || out.len() as u64 != ps {
            return Err(StoreError::InvalidInput(format!(
                "page {page} / buffer of {} bytes does not fit {} pages of {ps} bytes",
                out.len(),
                self.page_count()
            )));
        }
        let Some((li, ci, cp)) = self.locate(page) else {
            out.fill(0);
            return Ok(());
        };
        if self
            .recent
            .as_ref()
            .is_none_or(|(l, c, _)| (*l, *c) != (li, ci))
        {
            let obj = &self.chain[li].manifest.chunks[ci];
            self.recent = Some((li, ci, self.cache.read_object_raw(obj)?));
        }
        let data = &self.recent.as_ref().expect("loaded").2;
        let from = (cp * ps) as usize;
        out.copy_from_slice(&data[from..from + ps as usize]);
        Ok(())
    }
}

/// Pages a layer nearer the head already gave (or zeroed): disjoint `[start, end)` stretches,
/// so what it holds grows with the runs read, not with the memory size a manifest declares.
#[derive(Debug, Default)]
struct Settled(std::collections::BTreeMap<u64, u64>);

impl Settled {
    /// The end of the stretch holding page `p`, if one does.
    fn covering(&self, p: u64) -> Option<u64> {
        self.0
            .range(..=p)
            .next_back()
            .and_then(|(_, &end)| (p < end).then_some(end))
    }

    /// Where the first stretch after page `p` starts.
    fn next_start(&self, p: u64) -> Option<u64> {
        self.0.range(p.saturating_add(1)..).next().map(|(&s, _)| s)
    }

    fn set_range(&mut self, from: u64, to: u64) {
        if from >= to {
            return;
        }
        let (mut start, mut end) = (from, to);
        if let Some((&s, &e)) = self.0.range(..=from).next_back() {
            if e >= from {
                start = s;
                end = end.max(e);
            }
        }
        let absorbed: Vec<u64> = self.0.range(start..=end).map(|(&s, _)| s).collect();
        for s in absorbed {
            if let Some(e) = self.0.remove(&s) {
                end = end.max(e);
            }
        }
        self.0.insert(start, end);
    }
}

#[cfg(test)]
mod settled_tests {
    use super::Settled;

    #[test]
    fn stretches_merge_and_answer_lookups() {
        let mut s = Settled::default();
        s.set_range(10, 20);
        s.set_range(30, 40);
        assert_eq!(
            (
                s.covering(9),
                s.covering(10),
                s.covering(19),
                s.covering(20)
            ),
            (None, Some(20), Some(20), None)
        );
        assert_eq!(
            (s.next_start(0), s.next_start(10), s.next_start(25)),
            (Some(10), Some(30), Some(30))
        );
        s.set_range(20, 30); // touching both: one stretch
        assert_eq!(s.0.len(), 1);
        assert_eq!(s.covering(25), Some(40));
        s.set_range(5, 50); // covering it
        assert_eq!(s.0.iter().collect::<Vec<_>>(), [(&5, &50)]);
        // A declared span of 2^40 pages costs one entry.
        s.set_range(1 << 20, 1 << 40);
        assert_eq!(s.0.len(), 2);
        assert_eq!(s.covering((1 << 40) - 1), Some(1 << 40));
        assert_eq!(s.next_start(60), Some(1 << 20));
    }
}
