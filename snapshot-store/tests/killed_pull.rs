//! A pull killed with SIGKILL mid-transfer leaves nothing that looks valid
//! and is not: every object in the cache hashes to its name, no manifest is
//! there without its chain's objects, the temp files it was writing are swept
//! by the next `LocalCache::open`, and a second pull fetches exactly what is
//! missing and assembles the source memory byte for byte.
//!
//! Its own main (harness = false): started as `killed_pull __puller STORE
//! CACHE HEAD`, this binary is the puller process that gets killed.

mod common;

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use tine_snapshot_store::assemble::assemble;
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::progress::NoProgress;
use tine_snapshot_store::remote::RemoteStore;
use tine_snapshot_store::Digest;

const PULLER: &str = "__puller";
const TEST: &str = "pull_killed_mid_transfer_leaves_only_valid_objects_and_resumes";
const MAX_TRIES: u32 = 20;

fn main() {
    own_main(
        TEST,
        PULLER,
        |args| puller(Path::new(&args[0]), Path::new(&args[1]), &args[2]),
        pull_killed_mid_transfer,
    );
}

/// The child: pull `head` from the directory store into the cache.
fn puller(store: &Path, cache: &Path, head: &str) {
    let remote = local_store(store);
    let cache = LocalCache::open(cache).unwrap();
    let head = Digest::parse(head).unwrap();
    runtime()
        .block_on(remote.pull_head(&cache, &head, &NoProgress))
        .unwrap();
}

fn pull_killed_mid_transfer() {
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let src = LocalCache::open(dir.path().join("src")).unwrap();
    let (heads, memory) = random_chain(&src, dir.path());
    let head = heads[2];
    let store = dir.path().join("store");
    let remote = RemoteStore::open_local(&store).unwrap();
    let rt = runtime();
    rt.block_on(remote.push(&src, &head, None, &NoProgress))
        .unwrap();
    let chain = src.chain(&head).unwrap();
    let all: BTreeSet<Digest> = chain
        .iter()
        .flat_map(|l| l.object_refs())
        .map(|o| Digest::from_bytes(&o.hash).unwrap())
        .collect();
    let stored: u64 = chain.iter().map(|l| l.stored_bytes()).sum();
    println!(
        "source: {} layers, {} objects, {:.1} MiB stored, built and pushed in {:?}",
        chain.len(),
        all.len(),
        stored as f64 / 1048576.0,
        t.elapsed()
    );

    let exe = std::env::current_exe().unwrap();
    for attempt in 1..=MAX_TRIES {
        let cache_dir = dir.path().join(format!("cache-{attempt}"));
        let started = Instant::now();
        let mut child = Command::new(&exe)
            .arg(PULLER)
            .arg(&store)
            .arg(&cache_dir)
            .arg(head.hex())
            .spawn()
            .unwrap();
        // Kill once objects are landing and more are being written.
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            if !files(&cache_dir.join("chunks")).is_empty()
                && !files(&cache_dir.join("tmp")).is_empty()
            {
                child.kill().unwrap();
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the puller neither progressed nor exited"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        let status = child.wait().unwrap();
        let took = started.elapsed();
        let present = files(&cache_dir.join("chunks"));
        let leftovers = files(&cache_dir.join("tmp"));
        let killed = status.signal() == Some(libc::SIGKILL);
        println!(
            "try {attempt}: {} after {took:?}: {}/{} objects in the cache, {} temp files left",
            if killed { "killed" } else { "exited" },
            present.len(),
            all.len(),
            leftovers.len()
        );
        if !killed || present.is_empty() || present.len() >= all.len() || leftovers.is_empty() {
            continue; // the kill did not land mid-transfer; try again
        }
        check_after_kill(&cache_dir, &all);

        // The next open sweeps what the killed writer left in tmp/.
        let cache = LocalCache::open(&cache_dir).unwrap();
        assert!(
            files(&cache_dir.join("tmp")).is_empty(),
            "open left temp files: {:?}",
            files(&cache_dir.join("tmp"))
        );

        // A second pull completes, fetching only what is missing.
        let t = Instant::now();
        let summary = rt
            .block_on(remote.pull_head(&cache, &head, &NoProgress))
            .unwrap();
        println!("second pull in {:?}: {summary:?}", t.elapsed());
        assert_eq!(summary.objects_skipped, present.len() as u64);
        assert_eq!(
            summary.objects_transferred,
            (all.len() - present.len()) as u64
        );
        assert_eq!(summary.layers_transferred, 3);
        assert_same_file(&assemble(&cache, &head).unwrap(), &memory);
        return;
    }
    panic!("no kill landed mid-transfer in {MAX_TRIES} tries");
}

/// What a killed pull may leave: objects that verify, and no manifest
/// without its whole chain and every object that chain names.
fn check_after_kill(cache_dir: &Path, all: &BTreeSet<Digest>) {
    assert_only_whole_objects_and_chains(cache_dir, all, |_| false);
    assert!(
        files(&cache_dir.join("images")).is_empty(),
        "an image appeared before its chain was complete"
    );
}
