//! Turning a chain into something a VMM can map.
//!
//! [`assemble`] writes the flat image of a head once into the cache
//! (`images/<head>.mem`, sparse: zero pages are holes) and returns its path on
//! every later call without reading a single chunk, so spawn cost does not
//! depend on chain depth. Layers are applied head first and a page bitmap
//! records which pages are settled, so every page is written at most once and
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
    let pages = top.page_count();
    crate::fsutil::write_atomic_with(&cache.tmp_dir(), &path, |file| {
        file.set_len(top.manifest.memory_size)?;
        write_chain(cache, &chain, file, pages, page_size).map_err(std::io::Error::other)
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

fn write_chain(
    cache: &LocalCache,
    chain: &[Layer],
    file: &File,
    pages: u64,
    page_size: u64,
) -> Result<()> {
    let mut settled = Bitmap::new(pages);
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
                // Contiguous unsettled stretch [p, q).
                if settled.get(p) {
                    p += 1;
                    continue;
                }
                let mut q = p + 1;
                while q < end && !settled.get(q) {
                    q += 1;
                }
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

struct Bitmap(Vec<u64>);

impl Bitmap {
    fn new(bits: u64) -> Self {
        Bitmap(vec![0; bits.div_ceil(64) as usize])
    }
    fn get(&self, i: u64) -> bool {
        self.0[(i / 64) as usize] & (1 << (i % 64)) != 0
    }
    fn set_range(&mut self, from: u64, to: u64) {
        for i in from..to {
            self.0[(i / 64) as usize] |= 1 << (i % 64);
        }
    }
}
