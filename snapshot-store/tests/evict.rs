//! The cache's size bound: usage accounting and LRU eviction over real
//! builder-made chains, two of which share chunks.

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use common::*;
use tine_snapshot_store::assemble::assemble;
use tine_snapshot_store::builder::{build_base, build_diff, BuildOptions, DirtyPages, LayerInput};
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::{Digest, Layer};

/// 4 MiB regions of 4 KiB pages: one chunk per fully written region.
const REGION_PAGES: u64 = 1024;

fn write_memory(path: &Path, pages: u64, content: impl Fn(u64) -> Option<u64>) {
    let f = create_memory(path, pages);
    for p in 0..pages {
        if let Some(seed) = content(p) {
            write_page(&f, p, &page_bytes(seed));
        }
    }
}

fn base(cache: &LocalCache, memory: &Path, state: &str) -> Layer {
    let input = LayerInput {
        memory,
        page_size: PAGE as u32,
        state: state.as_bytes(),
    };
    build_base(cache, &input, &BuildOptions::default()).unwrap()
}

/// A diff on `parent`: copies `from` to `to` and rewrites `dirty`.
fn diff(
    cache: &LocalCache,
    parent: &Digest,
    from: &Path,
    to: &Path,
    dirty: &[u64],
    salt: u64,
) -> Layer {
    std::fs::copy(from, to).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(to).unwrap();
    for &p in dirty {
        write_page(&f, p, &page_bytes(p ^ salt));
    }
    drop(f);
    let input = LayerInput {
        memory: to,
        page_size: PAGE as u32,
        state: b"diff",
    };
    build_diff(
        cache,
        parent,
        &input,
        DirtyPages::List(dirty),
        &BuildOptions::default(),
    )
    .unwrap()
}

fn set_mtime(path: &Path, secs_ago: u64) {
    std::fs::File::open(path)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(secs_ago))
        .unwrap();
}

fn mtime(path: &Path) -> SystemTime {
    std::fs::metadata(path).unwrap().modified().unwrap()
}

fn disk(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

fn objects_of(l: &Layer) -> BTreeSet<Digest> {
    l.object_refs()
        .map(|o| Digest::from_bytes(&o.hash).unwrap())
        .collect()
}

/// The cache invariant eviction must keep: every manifest's whole chain is
/// present, every object a manifest names is present and hashes to its name.
fn assert_consistent(cache: &LocalCache) {
    for d in cache.list_layers().unwrap() {
        let chain = cache
            .chain(&d)
            .unwrap_or_else(|e| panic!("layer {d} lost its chain: {e}"));
        for l in &chain {
            for o in objects_of(l) {
                let bytes = cache
                    .read_object(&o)
                    .unwrap_or_else(|e| panic!("layer {} names a missing object: {e}", l.digest));
                assert_eq!(Digest::of(&bytes), o, "object {o} is damaged");
            }
        }
    }
}

struct Fixture {
    _dir: tempfile::TempDir,
    cache: LocalCache,
    a0: Layer,
    a1: Layer,
    b0: Layer,
    b1: Layer,
    c0: Layer,
    b1_memory: PathBuf,
}

/// Chains A (a0 ← a1), B (b0 ← b1) and C (c0). a0 and b0 are bases of
/// memories that differ only in the last of their four regions, so they share
/// three chunks. Images of a0, a1, b1 and c0 are assembled.
fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let pages = 4 * REGION_PAGES;
    let (ma0, mb0, mc0) = (
        dir.path().join("a0"),
        dir.path().join("b0"),
        dir.path().join("c0"),
    );
    write_memory(&ma0, pages, Some);
    write_memory(&mb0, pages, |p| {
        Some(if p >= 3 * REGION_PAGES {
            p ^ (1 << 40)
        } else {
            p
        })
    });
    // Sparse: the image of c0 is mostly holes.
    write_memory(&mc0, pages, |p| (p % 8 == 0).then_some(p ^ (1 << 41)));
    let a0 = base(&cache, &ma0, "a0");
    let b0 = base(&cache, &mb0, "b0");
    let c0 = base(&cache, &mc0, "c0");
    let shared: Vec<_> = objects_of(&a0)
        .intersection(&objects_of(&b0))
        .copied()
        .collect();
    assert_eq!(
        shared.len(),
        3,
        "a0 and b0 should share three region chunks"
    );
    let dirty: Vec<u64> = (0..200).map(|i| i * 17 % pages).collect();
    let a1 = diff(
        &cache,
        &a0.digest,
        &ma0,
        &dir.path().join("a1"),
        &dirty,
        1 << 42,
    );
    let b1_memory = dir.path().join("b1");
    let b1 = diff(&cache, &b0.digest, &mb0, &b1_memory, &dirty, 1 << 43);
    for l in [&a0, &a1, &b1, &c0] {
        assemble(&cache, &l.digest).unwrap();
    }
    Fixture {
        _dir: dir,
        cache,
        a0,
        a1,
        b0,
        b1,
        c0,
        b1_memory,
    }
}

#[test]
fn usage_counts_allocated_blocks_of_sparse_images() {
    let f = fixture();
    let u = f.cache.usage().unwrap();
    let c0_image = f.cache.image_path(&f.c0.digest);
    let len = std::fs::metadata(&c0_image).unwrap().len();
    println!(
        "usage {u:?}; c0 image: {len} bytes long, {} on disk",
        disk(&c0_image)
    );
    assert_eq!(len, 16 << 20);
    assert!(
        disk(&c0_image) < len / 4,
        "c0's image should be mostly holes"
    );
    let images: u64 = [&f.a0, &f.a1, &f.b1, &f.c0]
        .iter()
        .map(|l| disk(&f.cache.image_path(&l.digest)))
        .sum();
    assert_eq!(u.images, images);
    assert!(u.images < 4 * len, "usage must not count holes");
    assert!(u.chunks > 0 && u.layers > 0);
    assert_eq!(u.total(), u.chunks + u.layers + u.images);
}

#[test]
fn assemble_of_an_existing_image_marks_it_used() {
    let f = fixture();
    let image = f.cache.image_path(&f.a1.digest);
    let manifest = f.cache.layer_path(&f.a1.digest);
    set_mtime(&image, 1000);
    set_mtime(&manifest, 1000);
    let before = SystemTime::now() - Duration::from_secs(60);
    assert!(mtime(&image) < before);
    assert_eq!(assemble(&f.cache, &f.a1.digest).unwrap(), image);
    assert!(mtime(&image) > before, "image not touched");
    assert!(mtime(&manifest) > before, "head manifest not touched");
}

#[test]
fn eviction_goes_debris_then_lru_images_then_lru_layers_and_spares_in_use_chains() {
    let f = fixture();
    let cache = &f.cache;
    let image = |l: &Layer| cache.image_path(&l.digest);
    // Recency: a0's image is the oldest, then c0, then a1, then b1. Chain C
    // was used before chain A.
    for (l, ago) in [(&f.a0, 400), (&f.c0, 300), (&f.a1, 200), (&f.b1, 100)] {
        set_mtime(&image(l), ago);
        set_mtime(&cache.layer_path(&l.digest), ago);
    }
    let b1 = f.b1.digest;
    let in_use = move |d: &Digest| *d == b1;

    // Debris first: an object no manifest names (what a killed pull leaves).
    let orphan = zstd::bulk::compress(&page_bytes(999), 3).unwrap();
    let orphan_digest = Digest::of(&orphan);
    cache.put_object_verified(&orphan_digest, &orphan).unwrap();
    let u = cache.usage().unwrap();
    let r = cache.evict_to(u.total() - 1, &in_use).unwrap();
    println!("step 1: {r:?}");
    assert_eq!(r.objects_removed, 1);
    assert!(!cache.has_object(&orphan_digest));
    assert!(r.removed_images.is_empty() && r.removed_layers.is_empty());
    assert!(r.within_bound());

    // Images by recency, one at a time.
    let u = cache.usage().unwrap();
    let a0_image = disk(&image(&f.a0));
    let r = cache.evict_to(u.total() - 1, &in_use).unwrap();
    println!("step 2: removed images {:?}", r.removed_images);
    assert_eq!(r.removed_images, vec![f.a0.digest]);
    assert_eq!(r.after.total(), u.total() - a0_image);
    assert!(r.removed_layers.is_empty() && r.within_bound());
    let r = cache
        .evict_to(cache.usage().unwrap().total() - 1, &in_use)
        .unwrap();
    assert_eq!(r.removed_images, vec![f.c0.digest]);

    // Past the last unused image, whole layers go: chain C (used longest
    // ago) before chain A, and only as much as the bound needs.
    let u = cache.usage().unwrap();
    let r = cache
        .evict_to(u.total() - disk(&image(&f.a1)) - 1, &in_use)
        .unwrap();
    println!("step 3: {r:?}");
    assert_eq!(r.removed_images, vec![f.a1.digest]);
    assert_eq!(r.removed_layers, vec![f.c0.digest]);
    assert_eq!(r.objects_removed, objects_of(&f.c0).len() as u64);
    assert!(r.within_bound());
    for o in objects_of(&f.c0) {
        assert!(!cache.has_object(&o), "c0's object {o} survived");
    }
    assert!(cache.has_layer(&f.a1.digest) && cache.has_layer(&f.a0.digest));
    assert_consistent(cache);

    // A bound nothing can meet: everything not in use goes, leaves first;
    // the in-use chain, its image and the chunks a0 shared with b0 stay.
    let r = cache.evict_to(0, &in_use).unwrap();
    println!("step 4: {r:?}");
    assert_eq!(r.removed_layers, vec![f.a1.digest, f.a0.digest]);
    assert!(!r.within_bound(), "the in-use chain alone exceeds 0 bytes");
    assert_eq!(r.layers_in_use, 2);
    let kept: BTreeSet<Digest> = objects_of(&f.b0)
        .union(&objects_of(&f.b1))
        .copied()
        .collect();
    for o in &kept {
        assert!(
            cache.has_object(o),
            "object {o} of the in-use chain is gone"
        );
    }
    let a_only: BTreeSet<Digest> = objects_of(&f.a0)
        .union(&objects_of(&f.a1))
        .filter(|o| !kept.contains(o))
        .copied()
        .collect();
    assert_eq!(r.objects_removed, a_only.len() as u64);
    for o in &a_only {
        assert!(!cache.has_object(o), "a's own object {o} survived");
    }
    assert!(image(&f.b1).is_file());
    assert_eq!(cache.list_layers().unwrap().len(), 2);
    assert_consistent(cache);
    // The shared chunks really are intact: rebuild b1's image from them.
    std::fs::remove_file(image(&f.b1)).unwrap();
    assert_same_file(&assemble(cache, &b1).unwrap(), &f.b1_memory);

    // Nothing in use: the cache empties.
    let r = cache.evict_to(0, &|_: &Digest| false).unwrap();
    println!("step 5: {r:?}");
    assert_eq!(r.removed_layers, vec![b1, f.b0.digest]);
    assert_eq!(r.after.total(), 0);
    assert!(r.within_bound());
}

#[test]
fn under_the_bound_nothing_is_touched() {
    let f = fixture();
    let u = f.cache.usage().unwrap();
    let r = f.cache.evict_to(u.total(), &|_: &Digest| false).unwrap();
    assert_eq!(r.after, u);
    assert!(r.removed_images.is_empty() && r.removed_layers.is_empty());
    assert_eq!(r.objects_removed, 0);
    assert!(r.within_bound());
}

/// Pulls and evictions racing on one cache, the way a host runs them: the
/// puller marks its head in use before pulling and until it has assembled.
/// Every assembly must succeed byte for byte, and the cache must stay
/// consistent throughout (the cache lock keeps an eviction from taking an
/// object a pull already counted as present).
#[test]
fn eviction_racing_pulls_never_breaks_a_chain_in_use() {
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use tine_snapshot_store::progress::NoProgress;
    use tine_snapshot_store::remote::RemoteStore;

    let dir = tempfile::tempdir().unwrap();
    let src = LocalCache::open(dir.path().join("src")).unwrap();
    let chain = build_chain(&src, dir.path(), 2048, 600, 100);
    let head = chain.heads[2];
    let remote = RemoteStore::open_local(&dir.path().join("store")).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(remote.push(&src, &head, None, &NoProgress))
        .unwrap();

    let cache = LocalCache::open(dir.path().join("host")).unwrap();
    let in_use = AtomicBool::new(false);
    let done = AtomicBool::new(false);
    let evictions = AtomicU32::new(0);
    let emptied = AtomicU32::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(Ordering::SeqCst) {
                let r = cache
                    .evict_to(0, &|d: &Digest| in_use.load(Ordering::SeqCst) && *d == head)
                    .unwrap();
                evictions.fetch_add(1, Ordering::SeqCst);
                if r.after.total() == 0 {
                    emptied.fetch_add(1, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        // Stops the evictor however this thread leaves the scope (a failed
        // assertion included), or the scope would wait for it forever.
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let _stop = StopOnDrop(&done);
        for _ in 0..25 {
            in_use.store(true, Ordering::SeqCst);
            rt.block_on(remote.pull_head(&cache, &head, &NoProgress))
                .unwrap();
            assert_same_file(&assemble(&cache, &head).unwrap(), &chain.memories[2]);
            in_use.store(false, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    println!(
        "{} evictions ran alongside 25 pulls; {} emptied the cache",
        evictions.load(Ordering::SeqCst),
        emptied.load(Ordering::SeqCst)
    );
    assert!(
        emptied.load(Ordering::SeqCst) > 0,
        "eviction never ran while the head was unused"
    );
    assert_consistent(&cache);
}
