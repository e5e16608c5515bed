//! Layer building, chain assembly and page reads against the local cache.

mod common;

use std::os::unix::fs::MetadataExt;

use common::*;
use tine_snapshot_store::assemble::{assemble, PageReader};
use tine_snapshot_store::builder::{build_diff, BuildOptions, DirtyPages, LayerInput};
use tine_snapshot_store::cache::LocalCache;

#[test]
fn three_layer_chain_assembles_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let chain = build_chain(&cache, dir.path(), 4096, 1500, 400);

    for (head, memory) in chain.heads.iter().zip(&chain.memories) {
        let image = assemble(&cache, head).unwrap();
        assert_same_file(&image, memory);
        // Zero pages are holes: the image allocates no more than its data.
        let meta = std::fs::metadata(&image).unwrap();
        assert!(
            meta.blocks() * 512 < meta.len() / 2,
            "image is not sparse: {} blocks",
            meta.blocks()
        );
        // Second call reuses the file.
        assert_eq!(assemble(&cache, head).unwrap(), image);
    }

    let head = chain.heads[2];
    let layers = cache.chain(&head).unwrap();
    assert_eq!(layers.len(), 3);
    assert_eq!(layers[0].manifest.depth, 2);
    let state = cache.read_object_raw(layers[0].state_ref()).unwrap();
    assert_eq!(state, b"state-2");

    // Page-granular reads agree with the flat file everywhere.
    let flat = std::fs::read(&chain.memories[2]).unwrap();
    let mut reader = PageReader::open(&cache, &head).unwrap();
    let mut page = vec![0u8; PAGE];
    for p in 0..reader.page_count() {
        reader.read_page(p, &mut page).unwrap();
        assert_eq!(
            page,
            flat[p as usize * PAGE..(p as usize + 1) * PAGE],
            "page {p}"
        );
    }
    assert!(reader.read_page(reader.page_count(), &mut page).is_err());
}

#[test]
fn diff_of_10k_dirty_pages_stores_about_10k_pages() {
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let pages = 128 * 1024;
    let chain = build_chain(&cache, dir.path(), pages, 40_000, 10_000);
    let diff = cache.read_layer(&chain.heads[1]).unwrap();
    let base = cache.read_layer(&chain.heads[0]).unwrap();
    let t = diff.totals();
    assert_eq!(t.stored_pages + t.zeroed_pages, 10_000);
    assert_eq!(t.zeroed_pages, 1_000);
    assert_eq!(t.raw_bytes, 9_000 * PAGE as u64);
    assert_eq!(base.totals().stored_pages, 40_000);
    // Stored size tracks the change, not the memory: well under a quarter of the base.
    assert!(
        diff.stored_bytes() * 3 < base.stored_bytes(),
        "diff {} vs base {}",
        diff.stored_bytes(),
        base.stored_bytes()
    );
    assert_same_file(
        &assemble(&cache, &chain.heads[2]).unwrap(),
        &chain.memories[2],
    );
}

#[test]
fn identical_content_dedupes_across_layers() {
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let chain = build_chain(&cache, dir.path(), 4096, 2000, 100);
    // Re-snapshotting the same memory as a new base yields the same digest
    // and adds no objects.
    let before = count_files(&cache.root().join("chunks"));
    let input = LayerInput {
        memory: &chain.memories[0],
        page_size: PAGE as u32,
        state: b"state-0",
    };
    let again =
        tine_snapshot_store::builder::build_base(&cache, &input, &BuildOptions::default()).unwrap();
    assert_eq!(again.digest, chain.heads[0]);
    assert_eq!(count_files(&cache.root().join("chunks")), before);
}

#[test]
fn diff_rejects_mismatched_memory_and_bad_pages() {
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let chain = build_chain(&cache, dir.path(), 1024, 100, 10);
    let small = dir.path().join("small");
    create_memory(&small, 512);
    let input = LayerInput {
        memory: &small,
        page_size: PAGE as u32,
        state: b"",
    };
    let err = build_diff(
        &cache,
        &chain.heads[0],
        &input,
        DirtyPages::List(&[1]),
        &BuildOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("parent"), "{err}");
    let input = LayerInput {
        memory: &chain.memories[0],
        page_size: PAGE as u32,
        state: b"",
    };
    let err = build_diff(
        &cache,
        &chain.heads[0],
        &input,
        DirtyPages::List(&[5000]),
        &BuildOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("beyond"), "{err}");
    let unknown = tine_snapshot_store::Digest::of(b"nope");
    let err = build_diff(
        &cache,
        &unknown,
        &input,
        DirtyPages::List(&[1]),
        &BuildOptions::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("not in the local cache"), "{err}");
}

#[test]
fn tags_roundtrip_and_validate() {
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let d = tine_snapshot_store::Digest::of(b"x");
    cache.set_tag("py3.12+pandas", &d).unwrap();
    assert_eq!(cache.get_tag("py3.12+pandas").unwrap(), d);
    assert_eq!(cache.resolve(&d.to_string()).unwrap(), d);
    assert!(cache
        .set_tag("../evil", &d)
        .unwrap_err()
        .to_string()
        .contains("invalid tag"));
    assert!(cache
        .get_tag("missing")
        .unwrap_err()
        .to_string()
        .contains("unknown tag"));
    assert_eq!(
        cache.list_tags().unwrap(),
        vec![("py3.12+pandas".to_string(), d)]
    );
}

fn count_files(dir: &std::path::Path) -> usize {
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            n += count_files(&e.path());
        } else {
            n += 1;
        }
    }
    n
}

/// A base layer built with a working set keeps that set's stored pages in leading chunks of
/// their own (in any order given, duplicates and zero pages included), assembles byte for byte
/// (working-set runs interleave with the others), and refuses a set past the memory's end.
#[test]
fn working_set_pages_get_chunks_of_their_own() {
    use tine_snapshot_store::builder::build_base;
    use tine_snapshot_store::manifest::PageSource;
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let pages = 8192u64; // 32 MiB
    let mem = dir.path().join("mem");
    let f = create_memory(&mem, pages);
    let mut rng = Rng(11);
    for p in pick_pages(&mut rng, pages, 3000) {
        write_page(&f, p, &page_bytes(p + 1));
    }
    // Touch order, spread over the memory, with a repeat and (likely) zero pages.
    let mut ws: Vec<u64> = (0..300).map(|_| rng.below(pages)).collect();
    ws.push(ws[0]);
    let input = LayerInput {
        memory: &mem,
        page_size: PAGE as u32,
        state: b"state",
    };
    let opts = BuildOptions {
        working_set: ws.clone(),
        ..BuildOptions::default()
    };
    let layer = tine_snapshot_store::builder::build_base(&cache, &input, &opts).unwrap();
    let m = &layer.manifest;
    let mut seen = std::collections::HashSet::new();
    let distinct: Vec<u64> = ws.iter().copied().filter(|p| seen.insert(*p)).collect();
    assert_eq!(m.working_set, distinct, "touch order kept, repeats dropped");
    assert!(m.working_set_chunks >= 1);
    for &p in &m.working_set {
        if let PageSource::Stored { chunk, .. } = layer.lookup(p) {
            assert!(
                (chunk as u32) < m.working_set_chunks,
                "page {p} is in chunk {chunk}"
            );
        }
    }
    let ws_bytes: u64 = m.chunks[..m.working_set_chunks as usize]
        .iter()
        .map(|c| c.raw_len)
        .sum();
    assert!(
        ws_bytes <= 300 * PAGE as u64,
        "only working-set pages: {ws_bytes}"
    );
    assert_same_file(&assemble(&cache, &layer.digest).unwrap(), &mem);

    let bad = BuildOptions {
        working_set: vec![pages],
        ..BuildOptions::default()
    };
    let err = build_base(&cache, &input, &bad).unwrap_err();
    assert!(err.to_string().contains("beyond"), "{err}");
}
