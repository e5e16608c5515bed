//! Building layers from a flat guest memory file.
//!
//! Chunking: candidate pages (every page for a base layer, the dirty pages
//! for a diff layer) are read in guest-physical order; zero pages are dropped
//! (base) or recorded as zero spans (diff). Stored pages are appended to the
//! current chunk, which may only close at a 4 MiB guest-physical region
//! boundary and only once it holds ≥ 1 MiB. Dense memory thus gets chunks
//! aligned to regions, so a change in one region leaves other regions' chunks
//! (and their hashes) untouched and they dedupe; sparse diffs merge regions
//! into chunks of 1–5 MiB instead of thousands of tiny objects.
//!
//! Compression and hashing run on worker threads; the reader thread only
//! reads and tests for zero.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use crate::cache::LocalCache;
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::manifest::{pb, Layer, FORMAT_VERSION};

/// Guest-physical alignment unit for chunk boundaries.
pub const REGION_BYTES: u64 = 4 << 20;
/// A chunk closes at a region boundary once it holds at least this much.
pub const MIN_CHUNK_BYTES: u64 = 1 << 20;
pub const DEFAULT_PAGE_SIZE: u32 = 4096;

#[derive(Debug, Clone)]
pub struct BuildOptions {
    pub zstd_level: i32,
    /// Compression threads; 0 = available parallelism.
    pub threads: usize,
    /// Base layers: pages a child touches until it is ready, in touch order. Their stored
    /// pages go into leading chunks of their own (`working_set_chunks`), so a host that lacks
    /// the layer can fetch just those before a child starts.
    pub working_set: Vec<u64>,
}

impl Default for BuildOptions {
    fn default() -> Self {
        // Level 3 (zstd's default) compresses guest memory well at several
        // hundred MB/s per core; higher levels cost far more than they save.
        BuildOptions {
            zstd_level: 3,
            threads: 0,
            working_set: Vec::new(),
        }
    }
}

/// Input for a layer: a flat memory file and the VMM's state blob.
#[derive(Debug, Clone, Copy)]
pub struct LayerInput<'a> {
    pub memory: &'a Path,
    pub page_size: u32,
    pub state: &'a [u8],
}

/// Pages written since the parent snapshot.
#[derive(Debug, Clone, Copy)]
pub enum DirtyPages<'a> {
    /// Bit `p % 64` of word `p / 64` set = page `p` dirty (KVM dirty-log layout).
    Bitmap(&'a [u64]),
    /// Page numbers, any order, duplicates allowed.
    List(&'a [u64]),
}

impl DirtyPages<'_> {
    fn to_sorted(self, pages: u64) -> Result<Vec<u64>> {
        let mut out: Vec<u64> = match self {
            DirtyPages::Bitmap(words) => {
                let mut v = Vec::new();
                for (wi, &w) in words.iter().enumerate() {
                    let mut bits = w;
                    while bits != 0 {
                        let b = bits.trailing_zeros() as u64;
                        v.push(wi as u64 * 64 + b);
                        bits &= bits - 1;
                    }
                }
                v
            }
            DirtyPages::List(list) => {
                let mut v = list.to_vec();
                v.sort_unstable();
                v.dedup();
                v
            }
        };
        if let Some(&last) = out.last() {
            if last >= pages {
                return Err(StoreError::InvalidInput(format!(
                    "dirty page {last} is beyond the memory's {pages} pages"
                )));
            }
        }
        out.shrink_to_fit();
        Ok(out)
    }
}

/// True when every byte is zero. Word-wise OR so it vectorises.
pub fn is_zero_page(page: &[u8]) -> bool {
    let mut words = page.chunks_exact(16);
    // Cheap early exit: most non-zero pages differ in their first bytes.
    if let Some(first) = words.next() {
        if u128::from_ne_bytes(first.try_into().expect("16 bytes")) != 0 {
            return false;
        }
    }
    let acc = words.by_ref().fold(0u128, |a, w| {
        a | u128::from_ne_bytes(w.try_into().expect("16 bytes"))
    });
    acc == 0 && words.remainder().iter().all(|&b| b == 0)
}

/// Builds a base layer: every non-zero page of `input.memory`.
pub fn build_base(
    cache: &LocalCache,
    input: &LayerInput<'_>,
    opts: &BuildOptions,
) -> Result<Layer> {
    // Objects are published before the manifest names them; eviction must not
    // see them in between (see cache module docs).
    let _lock = cache.lock_shared()?;
    let (file, memory_size) = open_memory(input)?;
    let pages = memory_size / u64::from(input.page_size);
    let candidates = Candidates::All(pages);
    build(cache, input, opts, &file, memory_size, None, candidates)
}

/// Builds a diff layer on `parent` (which must be in the cache) from the
/// pages listed in `dirty`; pages that are now zero become zero spans.
pub fn build_diff(
    cache: &LocalCache,
    parent: &Digest,
    input: &LayerInput<'_>,
    dirty: DirtyPages<'_>,
    opts: &BuildOptions,
) -> Result<Layer> {
    // Also keeps the parent from being evicted before the child names it.
    let _lock = cache.lock_shared()?;
    if !opts.working_set.is_empty() {
        return Err(StoreError::InvalidInput(
            "a working set is recorded for base layers only".into(),
        ));
    }
    let parent_layer = cache.read_layer(parent)?;
    let (file, memory_size) = open_memory(input)?;
    let pm = &parent_layer.manifest;
    if pm.memory_size != memory_size || pm.page_size != input.page_size {
        return Err(StoreError::InvalidInput(format!(
            "memory is {memory_size} bytes in {}-byte pages but parent {parent} has {} bytes in {}-byte pages",
            input.page_size, pm.memory_size, pm.page_size
        )));
    }
    let pages = memory_size / u64::from(input.page_size);
    let list = dirty.to_sorted(pages)?;
    build(
        cache,
        input,
        opts,
        &file,
        memory_size,
        Some(&parent_layer),
        Candidates::List(list),
    )
}

fn open_memory(input: &LayerInput<'_>) -> Result<(File, u64)> {
    let ps = u64::from(input.page_size);
    if !ps.is_power_of_two() || ps < 512 {
        return Err(StoreError::InvalidInput(format!(
            "page size {ps} is not a power of two ≥ 512"
        )));
    }
    let file =
        File::open(input.memory).map_err(StoreError::io("open memory file", input.memory))?;
    let len = file
        .metadata()
        .map_err(StoreError::io("stat memory file", input.memory))?
        .len();
    if len == 0 || !len.is_multiple_of(ps) {
        return Err(StoreError::InvalidInput(format!(
            "{}: size {len} is not a positive multiple of the page size {ps}",
            input.memory.display()
        )));
    }
    Ok((file, len))
}

enum Candidates {
    All(u64),
    List(Vec<u64>),
}

impl Candidates {
    /// Maximal runs of consecutive candidate pages, never crossing a region.
    fn runs(&self, region_pages: u64) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        match self {
            Candidates::All(pages) => {
                let mut p = 0;
                while p < *pages {
                    let n = region_pages.min(pages - p);
                    out.push((p, n));
                    p += n;
                }
            }
            Candidates::List(list) => {
                for &p in list {
                    match out.last_mut() {
                        Some((start, n)) if *start + *n == p && !p.is_multiple_of(region_pages) => {
                            *n += 1
                        }
                        _ => out.push((p, 1)),
                    }
                }
            }
        }
        out
    }
}

/// Append stored page `p` to the open chunk, extending its last run when contiguous.
fn append_page(open: &mut OpenChunk, page: &[u8], p: u64, ps: u64) {
    let chunk_page = open.data.len() as u64 / ps;
    open.data.extend_from_slice(page);
    match open.runs.last_mut() {
        Some(r)
            if r.first_page + r.page_count == p && r.chunk_page + r.page_count == chunk_page =>
        {
            r.page_count += 1
        }
        _ => open.runs.push(pb::PageRun {
            first_page: p,
            page_count: 1,
            chunk: 0,
            chunk_page,
        }),
    }
}

/// Pages accumulated for the chunk being filled.
struct OpenChunk {
    data: Vec<u8>,
    runs: Vec<pb::PageRun>,
}

struct Job {
    index: usize,
    raw: Vec<u8>,
}

fn build(
    cache: &LocalCache,
    input: &LayerInput<'_>,
    opts: &BuildOptions,
    file: &File,
    memory_size: u64,
    parent: Option<&Layer>,
    candidates: Candidates,
) -> Result<Layer> {
    let ps = u64::from(input.page_size);
    let region_pages = (REGION_BYTES / ps).max(1);
    let threads = match opts.threads {
        0 => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        n => n,
    };
    let level = opts.zstd_level;
    let results: Arc<Mutex<Vec<Option<Result<Staged>>>>> = Arc::default();
    let pages = memory_size / ps;
    // The working set: distinct pages in touch order, all inside the memory.
    let mut working_set = Vec::with_capacity(opts.working_set.len());
    let mut in_ws = vec![0u64; pages.div_ceil(64) as usize];
    for &p in &opts.working_set {
        if p >= pages {
            return Err(StoreError::InvalidInput(format!(
                "working set page {p} is beyond the memory's {pages} pages"
            )));
        }
        let (w, b) = ((p / 64) as usize, p % 64);
        if in_ws[w] & (1 << b) == 0 {
            in_ws[w] |= 1 << b;
            working_set.push(p);
        }
    }
    let is_ws = |p: u64| in_ws[(p / 64) as usize] & (1 << (p % 64)) != 0;

    type Scanned = (Vec<pb::PageRun>, Vec<pb::PageSpan>, u32);
    let scanned = std::thread::scope(|scope| -> Result<Scanned> {
        let (tx, rx) = mpsc::sync_channel::<Job>(threads * 2);
        let rx = Arc::new(Mutex::new(rx));
        for _ in 0..threads {
            let rx = Arc::clone(&rx);
            let results = Arc::clone(&results);
            scope.spawn(move || loop {
                let job = match rx.lock().expect("job queue").recv() {
                    Ok(job) => job,
                    Err(_) => break,
                };
                let r = store_object(cache, &job.raw, level);
                let mut res = results.lock().expect("results");
                if res.len() <= job.index {
                    res.resize_with(job.index + 1, || None);
                }
                res[job.index] = Some(r);
            });
        }
        let mut chunk_count = 0usize;
        let mut all_runs = Vec::new();
        let mut zeroed: Vec<pb::PageSpan> = Vec::new();
        let mut open = OpenChunk {
            data: Vec::new(),
            runs: Vec::new(),
        };
        let mut current_region = u64::MAX;
        let mut buf = Vec::new();
        let mut close = |open: &mut OpenChunk, all_runs: &mut Vec<pb::PageRun>| -> Result<bool> {
            if open.data.is_empty() {
                return Ok(false);
            }
            for mut r in open.runs.drain(..) {
                r.chunk = u32::try_from(chunk_count)
                    .map_err(|_| StoreError::InvalidInput("too many chunks".into()))?;
                all_runs.push(r);
            }
            let raw = std::mem::take(&mut open.data);
            tx.send(Job {
                index: chunk_count,
                raw,
            })
            .map_err(|_| StoreError::InvalidInput("compression worker died".into()))?;
            chunk_count += 1;
            Ok(true)
        };
        // Working-set pages first, in page order, in chunks of their own.
        let mut ws_chunks = 0u32;
        let mut sorted_ws = working_set.clone();
        sorted_ws.sort_unstable();
        buf.resize(ps as usize, 0);
        for &p in &sorted_ws {
            file.read_exact_at(&mut buf, p * ps)
                .map_err(StoreError::io("read memory file", input.memory))?;
            if is_zero_page(&buf) {
                continue;
            }
            append_page(&mut open, &buf, p, ps);
            if open.data.len() as u64 >= REGION_BYTES && close(&mut open, &mut all_runs)? {
                ws_chunks += 1;
            }
        }
        if close(&mut open, &mut all_runs)? {
            ws_chunks += 1;
        }
        for (start, count) in candidates.runs(region_pages) {
            let region = start / region_pages;
            if region != current_region {
                if open.data.len() as u64 >= MIN_CHUNK_BYTES {
                    close(&mut open, &mut all_runs)?;
                }
                current_region = region;
            }
            buf.resize((count * ps) as usize, 0);
            file.read_exact_at(&mut buf, start * ps)
                .map_err(StoreError::io("read memory file", input.memory))?;
            for (i, page) in buf.chunks_exact(ps as usize).enumerate() {
                let p = start + i as u64;
                if is_ws(p) {
                    continue; // in a working-set chunk already (or zero)
                }
                if is_zero_page(page) {
                    if parent.is_some() {
                        push_span(&mut zeroed, p);
                    }
                    continue;
                }
                append_page(&mut open, page, p, ps);
            }
        }
        close(&mut open, &mut all_runs)?;
        drop(tx);
        // Working-set runs came first; the manifest wants them all in page order.
        all_runs.sort_unstable_by_key(|r| r.first_page);
        Ok((all_runs, zeroed, ws_chunks))
    });

    // Gather every staged temp file first so an error anywhere removes them all.
    let results = std::mem::take(&mut *results.lock().expect("results"));
    let mut staged = Vec::new();
    let mut chunks = Vec::with_capacity(results.len());
    let mut first_err = None;
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok((obj, s))) => {
                chunks.push(obj);
                staged.extend(s);
            }
            Some(Err(e)) => first_err = first_err.or(Some(e)),
            None => {
                first_err = first_err.or(Some(StoreError::InvalidInput(format!(
                    "chunk {i} was never compressed"
                ))))
            }
        }
    }
    let outcome = (|| {
        let (runs, zeroed, ws_chunks) = scanned?;
        if let Some(e) = first_err {
            return Err(e);
        }
        let (state, s) = store_object(cache, input.state, level)?;
        staged.extend(s);
        // Objects must be durable under their names before a manifest names them.
        cache.publish_staged(&staged)?;
        Ok((state, runs, zeroed, ws_chunks))
    })();
    let (state, runs, zeroed, working_set_chunks) = match outcome {
        Ok(v) => v,
        Err(e) => {
            for (_, tmp) in &staged {
                let _ = std::fs::remove_file(tmp);
            }
            return Err(e);
        }
    };

    let totals = pb::LayerTotals {
        stored_pages: runs.iter().map(|r| r.page_count).sum(),
        zeroed_pages: zeroed.iter().map(|s| s.page_count).sum(),
        raw_bytes: chunks.iter().map(|c| c.raw_len).sum(),
        stored_bytes: chunks.iter().map(|c| c.stored_len).sum(),
    };
    let manifest = pb::LayerManifest {
        format_version: FORMAT_VERSION,
        hash_algorithm: pb::HashAlgorithm::Blake3 as i32,
        compression: pb::Compression::Zstd as i32,
        parent: parent
            .map(|p| p.digest.as_bytes().to_vec())
            .unwrap_or_default(),
        depth: parent.map(|p| p.manifest.depth + 1).unwrap_or(0),
        memory_size,
        page_size: input.page_size,
        chunks,
        pages: runs,
        zeroed,
        state: Some(state),
        totals: Some(totals),
        working_set,
        working_set_chunks,
    };
    let layer = Layer::from_manifest(manifest)?;
    cache.put_layer(&layer)?;
    tracing::debug!(digest = %layer.digest, depth = layer.manifest.depth, "layer built");
    Ok(layer)
}

fn push_span(spans: &mut Vec<pb::PageSpan>, page: u64) {
    match spans.last_mut() {
        Some(s) if s.first_page + s.page_count == page => s.page_count += 1,
        _ => spans.push(pb::PageSpan {
            first_page: page,
            page_count: 1,
        }),
    }
}

/// Compresses and hashes one object and stages it in the cache.
type Staged = (pb::ObjectRef, Option<(Digest, std::path::PathBuf)>);

fn store_object(cache: &LocalCache, raw: &[u8], level: i32) -> Result<Staged> {
    let stored = zstd::bulk::compress(raw, level)
        .map_err(|e| StoreError::InvalidInput(format!("zstd compression failed: {e}")))?;
    let digest = Digest::of(&stored);
    let staged = cache.stage_object(&digest, &stored)?;
    let r = pb::ObjectRef {
        hash: digest.as_bytes().to_vec(),
        stored_len: stored.len() as u64,
        raw_len: raw.len() as u64,
    };
    Ok((r, staged))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_detection() {
        let mut page = vec![0u8; 4096];
        assert!(is_zero_page(&page));
        page[4095] = 1;
        assert!(!is_zero_page(&page));
        page[4095] = 0;
        page[0] = 1;
        assert!(!is_zero_page(&page));
        assert!(is_zero_page(&[0u8; 20]));
        assert!(!is_zero_page(&[
            0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7
        ]));
    }

    #[test]
    fn dirty_pages_normalise() {
        let list = DirtyPages::List(&[5, 1, 5, 64]).to_sorted(100).unwrap();
        assert_eq!(list, vec![1, 5, 64]);
        let bits = [0b101u64, 1];
        assert_eq!(
            DirtyPages::Bitmap(&bits).to_sorted(100).unwrap(),
            vec![0, 2, 64]
        );
        let err = DirtyPages::List(&[100]).to_sorted(100).unwrap_err();
        assert!(err.to_string().contains("beyond"), "{err}");
    }

    #[test]
    fn runs_split_at_regions() {
        let c = Candidates::List(vec![1, 2, 3, 4, 8]);
        assert_eq!(c.runs(4), vec![(1, 3), (4, 1), (8, 1)]);
        assert_eq!(Candidates::All(10).runs(4), vec![(0, 4), (4, 4), (8, 2)]);
    }
}
