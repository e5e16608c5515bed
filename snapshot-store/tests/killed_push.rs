//! A push killed with SIGKILL mid-transfer leaves nothing in the store that looks valid and is
//! not: every object hashes to its name, no layer manifest is there without its whole chain
//! and every object that chain names, and the tag is not there (it is set last, once the chain
//! is complete). A second push completes, sending exactly what is missing, and a pull of the
//! tag assembles the source memory byte for byte.
//!
//! Its own main (harness = false): started as `killed_push __pusher CACHE STORE HEAD`, this
//! binary is the pusher process that gets killed.

mod common;

use std::collections::BTreeSet;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use tine_snapshot_store::assemble::assemble;
use tine_snapshot_store::cache::{tag_key, LocalCache, CHUNKS_DIR};
use tine_snapshot_store::progress::NoProgress;
use tine_snapshot_store::remote::RemoteStore;
use tine_snapshot_store::Digest;

const PUSHER: &str = "__pusher";
const TEST: &str = "push_killed_mid_transfer_leaves_only_valid_objects_and_no_tag";
const MAX_TRIES: u32 = 20;
const TAG: &str = "top";

fn main() {
    own_main(
        TEST,
        PUSHER,
        |args| pusher(Path::new(&args[0]), Path::new(&args[1]), &args[2]),
        push_killed_mid_transfer,
    );
}

/// The child: push `head` from the cache to the directory store, tagging it.
fn pusher(cache: &Path, store: &Path, head: &str) {
    let remote = local_store(store);
    let cache = LocalCache::open(cache).unwrap();
    let head = Digest::parse(head).unwrap();
    runtime()
        .block_on(remote.push(&cache, &head, Some(TAG), &NoProgress))
        .unwrap();
}

/// Objects (by their file name) in a directory store.
fn stored_objects(store: &Path) -> Vec<PathBuf> {
    files(&store.join(CHUNKS_DIR))
}

/// Objects that landed whole (named by a digest, not an upload in flight).
fn whole_objects(store: &Path) -> usize {
    stored_objects(store)
        .iter()
        .filter(|p| Digest::parse(p.file_name().unwrap().to_str().unwrap()).is_ok())
        .count()
}

fn push_killed_mid_transfer() {
    let dir = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let src_dir = dir.path().join("src");
    let src = LocalCache::open(&src_dir).unwrap();
    let (heads, memory) = random_chain(&src, dir.path());
    let head = heads[2];
    let chain = src.chain(&head).unwrap();
    let all: BTreeSet<Digest> = chain
        .iter()
        .flat_map(|l| l.object_refs())
        .map(|o| Digest::from_bytes(&o.hash).unwrap())
        .collect();
    println!(
        "source: {} layers, {} objects, built in {:?}",
        chain.len(),
        all.len(),
        t.elapsed()
    );
    drop(src);

    let exe = std::env::current_exe().unwrap();
    let rt = runtime();
    for attempt in 1..=MAX_TRIES {
        let store = dir.path().join(format!("store-{attempt}"));
        std::fs::create_dir_all(&store).unwrap();
        let started = Instant::now();
        let mut child = Command::new(&exe)
            .arg(PUSHER)
            .arg(&src_dir)
            .arg(&store)
            .arg(head.hex())
            .spawn()
            .unwrap();
        // Kill once some objects have landed whole and the rest are on their way.
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            if whole_objects(&store) >= 5 {
                child.kill().unwrap();
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the pusher neither progressed nor exited"
            );
            std::thread::sleep(Duration::from_micros(200));
        }
        let status = child.wait().unwrap();
        let took = started.elapsed();
        let whole = whole_objects(&store);
        let killed = status.signal() == Some(libc::SIGKILL);
        println!(
            "try {attempt}: {} after {took:?}: {whole} of {} objects in the store, {} files",
            if killed { "killed" } else { "exited" },
            all.len(),
            stored_objects(&store).len(),
        );
        if !killed || whole >= all.len() {
            continue; // the kill did not land mid-transfer; try again
        }
        check_after_kill(&store, &all);

        // A second push completes, sending only what is missing (an upload cut short is not
        // "already there": it is sent again).
        let remote = RemoteStore::open_local(&store).unwrap();
        let src = LocalCache::open(&src_dir).unwrap();
        let summary = rt
            .block_on(remote.push(&src, &head, Some(TAG), &NoProgress))
            .unwrap();
        println!("second push: {summary:?}");
        assert_eq!(
            summary.objects_transferred + summary.objects_skipped,
            all.len() as u64
        );
        assert_eq!(
            summary.objects_skipped, whole as u64,
            "what landed whole is reused"
        );
        let fresh = LocalCache::open(dir.path().join(format!("pulled-{attempt}"))).unwrap();
        let (pulled, _) = rt.block_on(remote.pull(&fresh, TAG, &NoProgress)).unwrap();
        assert_eq!(pulled, head);
        assert_same_file(&assemble(&fresh, &head).unwrap(), &memory);
        return;
    }
    panic!("no kill landed mid-transfer in {MAX_TRIES} tries");
}

/// What a killed push may leave in the store: objects whose file name is their content's
/// hash, manifests only with their whole chain and its objects, and no tag.
fn check_after_kill(store: &Path, all: &BTreeSet<Digest>) {
    // The file store's uploads in flight are not objects (their names say so).
    assert_only_whole_objects_and_chains(store, all, |name| name.contains('#'));
    assert!(
        !store.join(tag_key(TAG)).exists(),
        "the tag was set before its chain was complete"
    );
}
