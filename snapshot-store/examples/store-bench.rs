//! Snapshot store benchmark: hashing, compression, pack/unpack throughput,
//! chain assembly and spawn cost. Prints a table; asserts nothing.
//!
//!     cargo run --release -p tine-snapshot-store --example store-bench [-- --mib 512]
//!
//! All guest memory here is SYNTHETIC (described in the output); numbers on
//! real guest images come later from the executor.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::Digest as _;
use tine_snapshot_store::assemble::assemble;
use tine_snapshot_store::builder::{build_base, build_diff, BuildOptions, DirtyPages, LayerInput};
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::pack::{export_pack_to_file, import_pack_file, ImportOptions, PackHead};
use tine_snapshot_store::Digest;

const PAGE: usize = 4096;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

const WORDS: &[&str] = &[
    "import ",
    "numpy",
    " as ",
    "np\n",
    "def ",
    "self",
    "return ",
    "None",
    "0x00007f",
    "__init__",
    "\0\0\0\0",
    "lib/python3.12/",
    "site-packages/",
    "pandas",
    "PyObject",
    "    ",
    "True",
    "False",
    "dict",
    "tuple",
];

/// One page of the synthetic mix: 80 % zero, 10 % copies of a few recurring
/// pages (page-cache/zeroed-struct-like), 8 % text/pointer-like data, 2 % random.
fn synthetic_page(rng: &mut Rng, page: &mut [u8], recurring: &[Vec<u8>]) {
    let r = rng.next() % 100;
    if r < 80 {
        page.fill(0);
    } else if r < 90 {
        page.copy_from_slice(&recurring[(rng.next() % recurring.len() as u64) as usize]);
    } else if r < 98 {
        let mut off = 0;
        while off < page.len() {
            let w = WORDS[(rng.next() % WORDS.len() as u64) as usize].as_bytes();
            let n = w.len().min(page.len() - off);
            page[off..off + n].copy_from_slice(&w[..n]);
            off += n;
        }
    } else {
        for c in page.chunks_mut(8) {
            c.copy_from_slice(&rng.next().to_le_bytes()[..c.len()]);
        }
    }
}

fn write_synthetic(path: &Path, pages: u64, seed: u64) {
    let mut rng = Rng(seed);
    let recurring: Vec<Vec<u8>> = (0..16)
        .map(|i| {
            let mut p = vec![0u8; PAGE];
            for (j, b) in p.iter_mut().enumerate() {
                *b = ((i * 31 + j / 64) % 251) as u8;
            }
            p
        })
        .collect();
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)
        .unwrap();
    f.set_len(pages * PAGE as u64).unwrap();
    let mut page = vec![0u8; PAGE];
    for p in 0..pages {
        synthetic_page(&mut rng, &mut page, &recurring);
        if page.iter().any(|&b| b != 0) {
            f.write_all_at(&page, p * PAGE as u64).unwrap();
        }
    }
}

/// Dirties `count` random pages of `path` (10 % of them zeroed, the rest
/// rewritten with non-zero pages of the same synthetic mix), returning them.
fn dirty(path: &Path, pages: u64, count: usize, seed: u64) -> Vec<u64> {
    let mut rng = Rng(seed);
    let recurring: Vec<Vec<u8>> = (0..16).map(|i| vec![(i * 7 + 1) as u8; PAGE]).collect();
    let f = OpenOptions::new().write(true).open(path).unwrap();
    let mut set = std::collections::BTreeSet::new();
    while set.len() < count {
        set.insert(rng.next() % pages);
    }
    let mut page = vec![0u8; PAGE];
    for (i, &p) in set.iter().enumerate() {
        if i % 10 == 0 {
            page.fill(0);
        } else {
            loop {
                synthetic_page(&mut rng, &mut page, &recurring);
                if page.iter().any(|&b| b != 0) {
                    break;
                }
            }
        }
        f.write_all_at(&page, p * PAGE as u64).unwrap();
    }
    set.into_iter().collect()
}

fn gibps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / (1u64 << 30) as f64 / d.as_secs_f64()
}

fn best_of<T>(n: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut best = Duration::MAX;
    let mut out = None;
    for _ in 0..n {
        let t = Instant::now();
        let v = f();
        best = best.min(t.elapsed());
        out = Some(v);
    }
    (best, out.unwrap())
}

fn drop_image(cache: &LocalCache, head: &Digest) {
    let _ = std::fs::remove_file(cache.image_path(head));
}

/// Spawn-side cost once assembled: resolve the image, open, mmap MAP_PRIVATE,
/// read one byte per page (faults every page in).
fn spawn_cost(path_of: impl Fn() -> PathBuf) -> (Duration, Duration) {
    let t = Instant::now();
    let path = path_of();
    let f = File::open(&path).unwrap();
    let len = f.metadata().unwrap().len() as usize;
    // SAFETY: fresh private read-only mapping of a file we keep open; unmapped below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_PRIVATE,
            std::os::fd::AsRawFd::as_raw_fd(&f),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    let setup = t.elapsed();
    let t = Instant::now();
    let mut acc = 0u8;
    for off in (0..len).step_by(PAGE) {
        // SAFETY: off < len, inside the mapping.
        acc ^= unsafe { std::ptr::read_volatile((ptr as *const u8).add(off)) };
    }
    let touch = t.elapsed();
    std::hint::black_box(acc);
    // SAFETY: unmapping exactly what was mapped.
    unsafe { libc::munmap(ptr, len) };
    (setup, touch)
}

fn main() {
    let mib: u64 = std::env::args()
        .skip_while(|a| a != "--mib")
        .nth(1)
        .map(|v| v.parse().expect("--mib N"))
        .unwrap_or(512);
    let pages = mib * 1024 * 1024 / PAGE as u64;
    let dir = tempfile::tempdir_in(std::env::var_os("TMPDIR").unwrap_or("/tmp".into())).unwrap();
    println!(
        "# tine snapshot-store bench ({mib} MiB guest, {pages} pages of 4 KiB, temp dir {})",
        dir.path().display()
    );
    println!(
        "# cores: {}, single-threaded unless stated\n",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );

    // 1. Hash choice.
    let mut buf = vec![0u8; 256 << 20];
    let mut rng = Rng(1);
    for c in buf.chunks_mut(8) {
        c.copy_from_slice(&rng.next().to_le_bytes());
    }
    let (t_b3, _) = best_of(3, || blake3::hash(&buf));
    let (t_sha, _) = best_of(3, || sha2::Sha256::digest(&buf));
    println!("## hash (256 MiB random buffer, one core, best of 3)");
    println!("| hash    | GiB/s |");
    println!("|---------|-------|");
    println!("| blake3  | {:.2} |", gibps(buf.len() as u64, t_b3));
    println!(
        "| sha256  | {:.2} |  (sha2 crate; uses SHA-NI when the CPU has it)",
        gibps(buf.len() as u64, t_sha)
    );
    drop(buf);

    // 2. Base layer + compression.
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let mem = dir.path().join("mem");
    write_synthetic(&mem, pages, 7);
    let logical = pages * PAGE as u64;
    let input = LayerInput {
        memory: &mem,
        page_size: PAGE as u32,
        state: &[0u8; 64 << 10],
    };
    let t = Instant::now();
    let base = build_base(&cache, &input, &BuildOptions::default()).unwrap();
    let t_build = t.elapsed();
    let tot = base.totals();
    println!("\n## compression (SYNTHETIC idle-guest mix: 80% zero pages, 10% copies of 16 recurring pages,");
    println!("##   8% text/pointer-like pages, 2% random pages; zstd level 3, 1-5 MiB chunks)");
    println!("| logical | non-zero pages | stored (chunks+state) | ratio | base build |");
    println!("|---------|----------------|-----------------------|-------|------------|");
    println!(
        "| {} MiB | {} | {:.1} MiB | {:.1}x | {:.2} s ({:.2} GiB/s logical, {} threads) |",
        mib,
        tot.stored_pages,
        base.stored_bytes() as f64 / 1048576.0,
        logical as f64 / base.stored_bytes() as f64,
        t_build.as_secs_f64(),
        gibps(logical, t_build),
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    );

    // 3. Chain: 5 diffs of 10k dirty pages each (scaled to the guest size).
    let per_diff = ((pages as usize) * 10_000 / 131_072).max(1);
    let mut heads = vec![base.digest];
    let mut memories = vec![dir.path().join("mem-d0")];
    std::fs::copy(&mem, &memories[0]).unwrap();
    let mut diff_stored = Vec::new();
    for d in 1..=5u64 {
        let dirty_pages = dirty(&mem, pages, per_diff, 100 + d);
        let input = LayerInput {
            memory: &mem,
            page_size: PAGE as u32,
            state: &[d as u8; 64 << 10],
        };
        let l = build_diff(
            &cache,
            heads.last().unwrap(),
            &input,
            DirtyPages::List(&dirty_pages),
            &BuildOptions::default(),
        )
        .unwrap();
        diff_stored.push((
            l.totals().stored_pages + l.totals().zeroed_pages,
            l.stored_bytes(),
        ));
        heads.push(l.digest);
        let snap = dir.path().join(format!("mem-d{d}"));
        std::fs::copy(&mem, &snap).unwrap();
        memories.push(snap);
    }
    println!("\n## diff layers ({per_diff} dirty pages each, 10% of them zeroed)");
    for (i, (p, s)) in diff_stored.iter().enumerate() {
        println!(
            "| depth {} | {} dirty pages | {:.2} MiB stored |",
            i + 1,
            p,
            *s as f64 / 1048576.0
        );
    }

    // 4. Pack / unpack of the depth-3 chain.
    let pack_path = dir.path().join("chain.tpack");
    let head3 = heads[3];
    let heads_arg = [PackHead {
        tag: Some("bench".into()),
        head: head3,
    }];
    let (t_pack, summary) = best_of(3, || {
        export_pack_to_file(&cache, &heads_arg, None, &pack_path).unwrap()
    });
    let pack_len = std::fs::metadata(&pack_path).unwrap().len();
    let (t_unpack, _) = best_of(3, || {
        let dst = LocalCache::open(
            dir.path()
                .join(format!("unpack-{}", Instant::now().elapsed().as_nanos())),
        )
        .unwrap();
        let s = import_pack_file(&dst, &pack_path, &ImportOptions::default()).unwrap();
        let _ = std::fs::remove_dir_all(dst.root());
        s
    });
    println!("\n## pack / unpack (depth-3 chain, one core, warm page cache, best of 3; pack written with fsync)");
    println!("| op     | time      | pack-file GiB/s | logical GiB/s (memory described / s) |");
    println!("|--------|-----------|-----------------|--------------------------------------|");
    println!(
        "| pack   | {:>7.1} ms | {:>6.2} | {:>6.2} |",
        t_pack.as_secs_f64() * 1e3,
        gibps(pack_len, t_pack),
        gibps(summary.logical_bytes, t_pack)
    );
    println!(
        "| unpack | {:>7.1} ms | {:>6.2} | {:>6.2} |  (hash-verify every member, stage, fsync, rename)",
        t_unpack.as_secs_f64() * 1e3,
        gibps(pack_len, t_unpack),
        gibps(summary.logical_bytes, t_unpack)
    );
    println!(
        "pack file {:.1} MiB for {} MiB of memory ({} layers, {} objects)",
        pack_len as f64 / 1048576.0,
        mib,
        summary.layers,
        summary.objects
    );

    // 5. Assembly and spawn cost by depth.
    println!("\n## assembly (cold: image absent; best of 3) and spawn cost once assembled");
    println!("## spawn = resolve cached image (assemble() hit) + open + mmap(MAP_PRIVATE) + read 1 byte of every page;");
    println!("## 'flat' = the same step on the original flat memory file with identical content (best of 7)");
    println!("| chain   | assemble (cold) | spawn, assembled | spawn, flat file | ratio |");
    println!("|---------|-----------------|------------------|------------------|-------|");
    let (t_copy, _) = best_of(3, || {
        let flat_copy = dir.path().join("flat-copy");
        let _ = std::fs::remove_file(&flat_copy);
        std::fs::copy(&memories[0], &flat_copy).unwrap()
    });
    let spawn = |f: &dyn Fn() -> PathBuf| {
        let _ = spawn_cost(f); // warm the page cache
        (0..7)
            .map(|_| {
                let (a, b) = spawn_cost(f);
                a + b
            })
            .min()
            .unwrap()
    };
    for depth in [0usize, 1, 3, 5] {
        let head = heads[depth];
        let (t_asm, path) = best_of(3, || {
            drop_image(&cache, &head);
            assemble(&cache, &head).unwrap()
        });
        let same = std::fs::read(&path).unwrap() == std::fs::read(&memories[depth]).unwrap();
        let chained = spawn(&|| assemble(&cache, &head).unwrap());
        let flat = spawn(&|| memories[depth].clone());
        println!(
            "| depth {depth} | {:>10.1} ms | {:>11.2} ms | {:>11.2} ms | {:.3} |{}",
            t_asm.as_secs_f64() * 1e3,
            chained.as_secs_f64() * 1e3,
            flat.as_secs_f64() * 1e3,
            chained.as_secs_f64() / flat.as_secs_f64(),
            if same {
                ""
            } else {
                " MISMATCH vs source memory!"
            }
        );
    }
    println!(
        "(for scale: copying the flat {mib} MiB file with std::fs::copy takes {:.1} ms)",
        t_copy.as_secs_f64() * 1e3
    );
}
