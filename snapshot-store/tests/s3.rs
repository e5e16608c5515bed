//! Push/pull/GC against a real S3 implementation (moto_server).

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::*;
use object_store::ObjectStoreExt;
use tine_snapshot_store::assemble::assemble;
use tine_snapshot_store::cache::{object_key, LocalCache};
use tine_snapshot_store::gc::{collect_garbage, GcOptions, PushLease};
use tine_snapshot_store::progress::{NoProgress, Progress, ProgressEvent};
use tine_snapshot_store::remote::TransferOptions;
use tine_snapshot_store::retry::RetryPolicy;

#[derive(Default)]
struct Recorder(Mutex<Vec<ProgressEvent>>);

impl Progress for Recorder {
    fn update(&self, e: &ProgressEvent) {
        self.0.lock().unwrap().push(e.clone());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_layer_chain_moves_between_hosts_through_s3() {
    let Some(moto) = common::moto::start() else {
        return;
    };
    moto.create_bucket("tine");
    let remote = moto.store("tine", "snapshots");
    let dir = tempfile::tempdir().unwrap();
    let host_a = LocalCache::open(dir.path().join("host-a")).unwrap();
    let chain = build_chain(&host_a, dir.path(), 8192, 3000, 800);
    let head = chain.heads[2];

    // Push the base alone, then the head: the second push ships only the diffs.
    let first = remote
        .push(&host_a, &chain.heads[0], Some("base"), &NoProgress)
        .await
        .unwrap();
    assert_eq!(first.layers_transferred, 1);
    let rec = Recorder::default();
    let second = remote
        .push(&host_a, &head, Some("py+repo"), &rec)
        .await
        .unwrap();
    assert_eq!(second.layers_transferred, 2);
    let last = rec.0.lock().unwrap().last().cloned().unwrap();
    assert_eq!(last.done_objects + last.skipped_objects, last.total_objects);
    assert_eq!(last.done_bytes, second.bytes_transferred);
    // Pushing again transfers nothing.
    let again = remote
        .push(&host_a, &head, Some("py+repo"), &NoProgress)
        .await
        .unwrap();
    assert_eq!(
        (again.layers_transferred, again.objects_transferred),
        (0, 0)
    );
    assert_eq!(remote.get_tag("py+repo").await.unwrap(), head);

    // Another host with an empty cache pulls by tag and by digest.
    let host_b = LocalCache::open(dir.path().join("host-b")).unwrap();
    let (pulled, summary) = remote.pull(&host_b, "py+repo", &NoProgress).await.unwrap();
    assert_eq!(pulled, head);
    assert_eq!(summary.layers_transferred, 3);
    assert_eq!(host_b.get_tag("py+repo").unwrap(), head);
    assert_same_file(&assemble(&host_b, &head).unwrap(), &chain.memories[2]);
    let (mid, summary) = remote
        .pull(&host_b, &chain.heads[1].to_string(), &NoProgress)
        .await
        .unwrap();
    assert_eq!(
        (summary.objects_transferred, summary.layers_transferred),
        (0, 0)
    );
    assert_same_file(&assemble(&host_b, &mid).unwrap(), &chain.memories[1]);

    let tags = remote.list_tags().await.unwrap();
    assert_eq!(
        tags.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>(),
        ["base", "py+repo"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_remote_chunk_is_refused_and_cache_left_clean() {
    let Some(moto) = common::moto::start() else {
        return;
    };
    moto.create_bucket("tamper");
    let remote = moto.store("tamper", "");
    let dir = tempfile::tempdir().unwrap();
    let host_a = LocalCache::open(dir.path().join("a")).unwrap();
    let chain = build_chain(&host_a, dir.path(), 2048, 800, 200);
    remote
        .push(&host_a, &chain.heads[2], Some("t"), &NoProgress)
        .await
        .unwrap();

    // Corrupt one chunk of the diff layer in the bucket.
    let layer = host_a.read_layer(&chain.heads[2]).unwrap();
    let victim = layer.chunk_digest(0);
    let key = object_store::path::Path::from(object_key(&victim));
    let mut bytes = remote
        .object_store()
        .get(&key)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    bytes[10] ^= 0xff;
    remote.object_store().put(&key, bytes.into()).await.unwrap();

    let host_b = LocalCache::open(dir.path().join("b")).unwrap();
    let err = remote.pull(&host_b, "t", &NoProgress).await.unwrap_err();
    assert!(
        !err.is_unavailable(),
        "corrupt data is not an outage: {err}"
    );
    let err = err.to_string();
    assert!(
        err.contains(&victim.to_string()) && err.contains("failed verification"),
        "{err}"
    );
    for sub in ["chunks", "layers", "tags", "images", "tmp"] {
        let mut files = Vec::new();
        collect(&host_b.root().join(sub), &mut files);
        assert!(
            files.is_empty(),
            "{sub} not clean after refused pull: {files:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_on_s3_sweeps_unreferenced_and_respects_push_leases() {
    let Some(moto) = common::moto::start() else {
        return;
    };
    moto.create_bucket("gc-test");
    let remote = moto.store("gc-test", "");
    let dir = tempfile::tempdir().unwrap();
    let host = LocalCache::open(dir.path().join("a")).unwrap();
    let chain = build_chain(&host, dir.path(), 1024, 300, 50);
    remote
        .push(&host, &chain.heads[2], Some("keep"), &NoProgress)
        .await
        .unwrap();
    let orphan = tine_snapshot_store::Digest::of(b"orphan");
    let orphan_key = object_store::path::Path::from(object_key(&orphan));
    remote
        .object_store()
        .put(&orphan_key, b"orphan".to_vec().into())
        .await
        .unwrap();

    let now = GcOptions {
        min_age: Duration::ZERO,
        ..Default::default()
    };
    // A push in flight blocks the sweep.
    let lease = PushLease::acquire(&remote).await.unwrap();
    let err = collect_garbage(&remote, &now)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("push is in progress"), "{err}");
    lease.release(&remote).await;

    // Young garbage survives the default grace period.
    let report = collect_garbage(&remote, &GcOptions::default())
        .await
        .unwrap();
    assert_eq!((report.objects_deleted, report.objects_too_young), (0, 1));

    let report = collect_garbage(&remote, &now).await.unwrap();
    assert_eq!(report.objects_deleted, 1);
    assert_eq!(report.layers_live, 3);
    assert!(remote.object_store().head(&orphan_key).await.is_err());
    // Everything live is still pullable.
    let other = LocalCache::open(dir.path().join("b")).unwrap();
    let (head, _) = remote.pull(&other, "keep", &NoProgress).await.unwrap();
    assert_same_file(&assemble(&other, &head).unwrap(), &chain.memories[2]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_server_that_goes_away_is_unavailable() {
    let Some(moto) = common::moto::start() else {
        return;
    };
    moto.create_bucket("gone");
    let quick = TransferOptions {
        concurrency: 4,
        retry: RetryPolicy {
            max_attempts: 3,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(50),
            max_elapsed: Duration::from_secs(10),
        },
    };
    let remote = moto.store("gone", "p").with_options(quick);
    let dir = tempfile::tempdir().unwrap();
    let host_a = LocalCache::open(dir.path().join("a")).unwrap();
    let chain = build_chain(&host_a, dir.path(), 1024, 300, 50);
    let head = chain.heads[2];
    remote
        .push(&host_a, &head, Some("t"), &NoProgress)
        .await
        .unwrap();
    let endpoint = moto.endpoint.clone();
    drop(moto); // the server process is killed: connections are refused

    let host_b = LocalCache::open(dir.path().join("b")).unwrap();
    let t = std::time::Instant::now();
    let err = remote
        .pull_head(&host_b, &head, &NoProgress)
        .await
        .unwrap_err();
    println!("pull from a stopped moto_server: {:?}: {err}", t.elapsed());
    assert!(err.is_unavailable(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("s3://gone/p") && text.contains(&endpoint),
        "{text}"
    );
    assert!(t.elapsed() < Duration::from_secs(10));
    let mut files = Vec::new();
    collect(&host_b.root().join("layers"), &mut files);
    collect(&host_b.root().join("chunks"), &mut files);
    assert!(files.is_empty(), "{files:?}");
}

fn collect(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            collect(&e.path(), out);
        } else {
            out.push(e.path());
        }
    }
}

/// A bucket that does not exist is named as such, not taken for a missing tag or layer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_is_not_an_unknown_tag() {
    let Some(moto) = common::moto::start() else {
        return;
    };
    let remote = moto.store("never-created", "snapshots");
    let err = remote.get_tag("py").await.unwrap_err();
    println!("{err}");
    assert!(
        matches!(err, tine_snapshot_store::error::StoreError::RemoteConfig(_)),
        "{err:?}"
    );
    assert!(err.to_string().contains("bucket does not exist"), "{err}");
}
