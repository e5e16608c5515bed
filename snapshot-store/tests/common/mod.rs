//! Shared helpers: deterministic synthetic guest memory.
#![allow(dead_code)]

pub mod moto;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use tine_snapshot_store::builder::{build_base, build_diff, BuildOptions, DirtyPages, LayerInput};

pub const PAGE: usize = 4096;

/// splitmix64: a small deterministic generator, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Page contents that compress somewhat (like real memory) but differ per seed.
pub fn page_bytes(seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let mut page = vec![0u8; PAGE];
    page[..8].copy_from_slice(&seed.to_le_bytes());
    for b in page[8..].iter_mut() {
        *b = (rng.next() & 0x0f) as u8;
    }
    page
}

/// Creates a sparse memory file of `pages` pages.
pub fn create_memory(path: &Path, pages: u64) -> File {
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    f.set_len(pages * PAGE as u64).unwrap();
    f
}

pub fn write_page(f: &File, page: u64, bytes: &[u8]) {
    f.write_all_at(bytes, page * PAGE as u64).unwrap();
}

/// Distinct random page numbers below `pages`.
pub fn pick_pages(rng: &mut Rng, pages: u64, count: usize) -> Vec<u64> {
    let mut set = std::collections::BTreeSet::new();
    while set.len() < count {
        set.insert(rng.below(pages));
    }
    set.into_iter().collect()
}

/// Byte-for-byte comparison that reports the first differing page.
pub fn assert_same_file(a: &Path, b: &Path) {
    let (fa, fb) = (File::open(a).unwrap(), File::open(b).unwrap());
    let len = fa.metadata().unwrap().len();
    assert_eq!(len, fb.metadata().unwrap().len(), "sizes differ");
    let mut ba = vec![0u8; 1 << 20];
    let mut bb = vec![0u8; 1 << 20];
    let mut off = 0u64;
    while off < len {
        let n = ((len - off) as usize).min(ba.len());
        fa.read_exact_at(&mut ba[..n], off).unwrap();
        fb.read_exact_at(&mut bb[..n], off).unwrap();
        if ba[..n] != bb[..n] {
            let i = ba[..n]
                .iter()
                .zip(&bb[..n])
                .position(|(x, y)| x != y)
                .unwrap();
            panic!(
                "files differ at byte {} (page {})",
                off + i as u64,
                (off + i as u64) / PAGE as u64
            );
        }
        off += n as u64;
    }
}

/// A three-layer chain over a `pages`-page memory: base with `base_pages`
/// non-zero pages, then two diffs of `diff_pages` dirty pages each (a tenth
/// of which become zero). Returns (heads base-first, final memory path).
pub struct Chain {
    pub heads: Vec<tine_snapshot_store::Digest>,
    pub memories: Vec<std::path::PathBuf>,
}

pub fn build_chain(
    cache: &tine_snapshot_store::cache::LocalCache,
    dir: &Path,
    pages: u64,
    base_pages: usize,
    diff_pages: usize,
) -> Chain {
    use tine_snapshot_store::builder::{
        build_base, build_diff, BuildOptions, DirtyPages, LayerInput,
    };
    let mut rng = Rng(42);
    let opts = BuildOptions::default();
    let mem0 = dir.join("mem0");
    let f = create_memory(&mem0, pages);
    for p in pick_pages(&mut rng, pages, base_pages) {
        write_page(&f, p, &page_bytes(p));
    }
    drop(f);
    let input = LayerInput {
        memory: &mem0,
        page_size: PAGE as u32,
        state: b"state-0",
    };
    let base = build_base(cache, &input, &opts).unwrap();
    let mut heads = vec![base.digest];
    let mut memories = vec![mem0.clone()];
    for layer in 1..=2u64 {
        let prev = memories.last().unwrap().clone();
        let next = dir.join(format!("mem{layer}"));
        std::fs::copy(&prev, &next).unwrap();
        let f = OpenOptions::new().write(true).open(&next).unwrap();
        let dirty = pick_pages(&mut rng, pages, diff_pages);
        for (i, &p) in dirty.iter().enumerate() {
            if i % 10 == 0 {
                write_page(&f, p, &vec![0u8; PAGE]);
            } else {
                write_page(&f, p, &page_bytes(p ^ (layer << 40)));
            }
        }
        drop(f);
        let state = format!("state-{layer}");
        let input = LayerInput {
            memory: &next,
            page_size: PAGE as u32,
            state: state.as_bytes(),
        };
        let parent = *heads.last().unwrap();
        let l = if layer == 1 {
            build_diff(cache, &parent, &input, DirtyPages::List(&dirty), &opts).unwrap()
        } else {
            let mut bitmap = vec![0u64; pages.div_ceil(64) as usize];
            for p in &dirty {
                bitmap[(p / 64) as usize] |= 1 << (p % 64);
            }
            build_diff(cache, &parent, &input, DirtyPages::Bitmap(&bitmap), &opts).unwrap()
        };
        heads.push(l.digest);
        memories.push(next);
    }
    Chain { heads, memories }
}

/// A page of random bytes: zstd cannot shrink it, so the pull moves the
/// full size and takes long enough to be interrupted.
pub fn random_page(rng: &mut Rng) -> Vec<u8> {
    let mut page = vec![0u8; PAGE];
    for w in page.chunks_exact_mut(8) {
        w.copy_from_slice(&rng.next().to_le_bytes());
    }
    page
}

/// base (40 MiB of random pages over 64 MiB) ← diff (1024 pages) ← diff
/// (1024 pages). Returns the heads and the final memory.
pub fn random_chain(
    cache: &tine_snapshot_store::cache::LocalCache,
    dir: &Path,
) -> (Vec<tine_snapshot_store::Digest>, PathBuf) {
    let pages = 16 * 1024;
    let mut rng = Rng(7);
    let opts = BuildOptions::default();
    let mem = dir.join("mem0");
    let f = create_memory(&mem, pages);
    for p in 0..10 * 1024 {
        write_page(&f, p, &random_page(&mut rng));
    }
    drop(f);
    let input = layer_input(&mem, "state-0");
    let mut heads = vec![build_base(cache, &input, &opts).unwrap().digest];
    let mut prev = mem;
    for layer in 1..=2 {
        let next = dir.join(format!("mem{layer}"));
        std::fs::copy(&prev, &next).unwrap();
        let f = std::fs::OpenOptions::new().write(true).open(&next).unwrap();
        let dirty = pick_pages(&mut rng, pages, 1024);
        for &p in &dirty {
            write_page(&f, p, &random_page(&mut rng));
        }
        drop(f);
        let state = format!("state-{layer}");
        let input = layer_input(&next, &state);
        let parent = *heads.last().unwrap();
        let l = build_diff(cache, &parent, &input, DirtyPages::List(&dirty), &opts).unwrap();
        heads.push(l.digest);
        prev = next;
    }
    (heads, prev)
}

/// Regular files under `dir` (none if it does not exist yet).
pub fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let path = e.path();
        match e.file_type() {
            Ok(t) if t.is_dir() => out.extend(files(&path)),
            Ok(_) => out.push(path),
            Err(_) => {}
        }
    }
    out
}

/// The memory file and state of a layer to build.
pub fn layer_input<'a>(memory: &'a Path, state: &'a str) -> LayerInput<'a> {
    LayerInput {
        memory,
        page_size: PAGE as u32,
        state: state.as_bytes(),
    }
}

/// A two-worker runtime, as a store command uses.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The main of a test binary with its own harness (`harness = false`) that re-executes itself
/// as a child process to SIGKILL: started as `EXE CHILD ARGS...` it runs `child(ARGS)`;
/// otherwise it answers enough of libtest's interface (listing, a name filter) for `cargo
/// test` and runs `test`, named `name`.
pub fn own_main(name: &str, child_flag: &str, child: impl FnOnce(&[String]), test: impl FnOnce()) {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(child_flag) {
        child(&args[2..]);
        return;
    }
    if args.iter().any(|a| a == "--list") {
        println!("{name}: test");
        return;
    }
    if let Some(filter) = args.iter().skip(1).find(|a| !a.starts_with('-')) {
        if !name.contains(filter.as_str()) {
            println!("test result: ok. 0 passed; 0 failed; 0 ignored; 0 measured; 1 filtered out");
            return;
        }
    }
    println!("\nrunning 1 test");
    let t = std::time::Instant::now();
    test();
    println!("test {name} ... ok");
    println!(
        "\ntest result: ok. 1 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in {:.2}s\n",
        t.elapsed().as_secs_f64()
    );
}

/// A directory store as the killed transfers use it (four transfers at once).
pub fn local_store(store: &Path) -> tine_snapshot_store::remote::RemoteStore {
    tine_snapshot_store::remote::RemoteStore::open_local(store)
        .unwrap()
        .with_options(tine_snapshot_store::remote::TransferOptions {
            concurrency: 4,
            ..tine_snapshot_store::remote::TransferOptions::default()
        })
}

/// What a transfer killed mid-way may leave under `root`, a cache or a directory store (they
/// share their layout): objects that hash to their names and belong to `all`, and no layer
/// manifest without its whole chain and every object the chain names. Any other file must be
/// a transfer still in flight by its name (`in_flight`). Files are read directly: opening a
/// cache would sweep its tmp/ first.
pub fn assert_only_whole_objects_and_chains(
    root: &Path,
    all: &std::collections::BTreeSet<tine_snapshot_store::Digest>,
    in_flight: impl Fn(&str) -> bool,
) {
    use tine_snapshot_store::cache::{layer_key, object_key, CHUNKS_DIR, LAYERS_DIR};
    use tine_snapshot_store::{Digest, Layer};
    let digest_of = |path: &Path| {
        let name = path.file_name().unwrap().to_str().unwrap();
        let d = Digest::parse(name).ok();
        assert!(
            d.is_some() || in_flight(name),
            "stray file {}",
            path.display()
        );
        d
    };
    for path in files(&root.join(CHUNKS_DIR)) {
        let Some(d) = digest_of(&path) else { continue };
        assert!(all.contains(&d), "object {d} is not in the chain");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(
            Digest::of(&bytes),
            d,
            "{} is torn or damaged",
            path.display()
        );
    }
    for layer in files(&root.join(LAYERS_DIR)) {
        let mut next = digest_of(&layer);
        while let Some(d) = next {
            let bytes = std::fs::read(root.join(layer_key(&d)))
                .unwrap_or_else(|e| panic!("a manifest's ancestor {d} is missing: {e}"));
            let l = Layer::decode_verified(d, bytes).unwrap();
            for o in l.object_refs() {
                let o = Digest::from_bytes(&o.hash).unwrap();
                assert!(
                    root.join(object_key(&o)).is_file(),
                    "manifest {d} names missing {o}"
                );
            }
            next = l.parent();
        }
    }
}
