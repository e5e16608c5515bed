//! The directory backend (embedded mode), transient-failure retries, and GC.

mod common;

use std::ops::Range;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use tine_snapshot_store::assemble::assemble;
use tine_snapshot_store::cache::LocalCache;
use tine_snapshot_store::gc::{collect_cache_garbage, collect_garbage, GcOptions};
use tine_snapshot_store::progress::NoProgress;
use tine_snapshot_store::remote::{RemoteStore, TransferOptions};
use tine_snapshot_store::retry::RetryPolicy;

/// Fails the first put and the first get of every object with a transient error. Per object,
/// not per call count: with concurrent transfers a global "every other call" pattern can hand
/// one object more consecutive failures than any retry policy allows.
#[derive(Debug)]
struct Flaky {
    inner: Arc<dyn ObjectStore>,
    failed_once: std::sync::Mutex<std::collections::HashSet<(bool, String)>>,
    injected: AtomicU32,
}

impl std::fmt::Display for Flaky {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Flaky({})", self.inner)
    }
}

impl Flaky {
    fn trip(&self, write: bool, location: &Path) -> object_store::Result<()> {
        if self
            .failed_once
            .lock()
            .unwrap()
            .insert((write, location.to_string()))
        {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(object_store::Error::Generic {
                store: "flaky",
                source: "connection reset by peer".into(),
            });
        }
        Ok(())
    }
}

#[async_trait::async_trait]
impl ObjectStore for Flaky {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.trip(true, location)?;
        self.inner.put_opts(location, payload, opts).await
    }
    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }
    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.trip(false, location)?;
        self.inner.get_opts(location, options).await
    }
    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        self.inner.get_ranges(location, ranges).await
    }
    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }
    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

#[tokio::test]
async fn push_and_pull_survive_transient_failures() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    std::fs::create_dir_all(&store_dir).unwrap();
    let inner =
        Arc::new(object_store::local::LocalFileSystem::new_with_prefix(&store_dir).unwrap());
    let flaky = Arc::new(Flaky {
        inner,
        failed_once: Default::default(),
        injected: AtomicU32::new(0),
    });
    let policy = RetryPolicy {
        initial_backoff: Duration::from_millis(1),
        ..Default::default()
    };
    let remote =
        RemoteStore::from_object_store(flaky.clone(), "flaky").with_options(TransferOptions {
            concurrency: 4,
            retry: policy,
        });
    let a = LocalCache::open(dir.path().join("a")).unwrap();
    let chain = build_chain(&a, dir.path(), 2048, 700, 100);
    remote
        .push(&a, &chain.heads[2], Some("flaky"), &NoProgress)
        .await
        .unwrap();
    let b = LocalCache::open(dir.path().join("b")).unwrap();
    let (head, _) = remote.pull(&b, "flaky", &NoProgress).await.unwrap();
    assert_same_file(&assemble(&b, &head).unwrap(), &chain.memories[2]);
    assert!(
        flaky.injected.load(Ordering::SeqCst) > 5,
        "no failures were injected"
    );
}

#[tokio::test]
async fn directory_store_roundtrip_gc_and_locks() {
    let dir = tempfile::tempdir().unwrap();
    let remote = RemoteStore::open_url(dir.path().join("store").to_str().unwrap()).unwrap();
    let a = LocalCache::open(dir.path().join("a")).unwrap();
    let chain = build_chain(&a, dir.path(), 2048, 700, 100);
    remote
        .push(&a, &chain.heads[1], Some("mid"), &NoProgress)
        .await
        .unwrap();
    remote
        .push(&a, &chain.heads[2], Some("top"), &NoProgress)
        .await
        .unwrap();

    // Retag "top" to the middle layer: layer 2 becomes untagged garbage.
    remote.set_tag("top", &chain.heads[1]).await.unwrap();
    let now = GcOptions {
        min_age: Duration::ZERO,
        prune_untagged: true,
        dry_run: false,
    };
    let dry = collect_garbage(
        &remote,
        &GcOptions {
            dry_run: true,
            ..now.clone()
        },
    )
    .await
    .unwrap();
    let report = collect_garbage(&remote, &now).await.unwrap();
    assert_eq!(report, dry, "dry run must predict the real run");
    assert_eq!((report.layers_deleted, report.layers_live), (1, 2));
    assert!(report.objects_deleted >= 1);
    assert!(!remote.has_layer(&chain.heads[2]).await.unwrap());
    let b = LocalCache::open(dir.path().join("b")).unwrap();
    let (head, _) = remote.pull(&b, "top", &NoProgress).await.unwrap();
    assert_same_file(&assemble(&b, &head).unwrap(), &chain.memories[1]);

    // A running GC (its lock present) makes a push back off with a clear error.
    let lock = object_store::path::Path::from("locks/gc");
    remote
        .object_store()
        .put_opts(
            &lock,
            Bytes::from_static(b"gc").into(),
            PutOptions::default(),
        )
        .await
        .unwrap();
    let err = remote
        .push(&a, &chain.heads[2], None, &NoProgress)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("garbage collection is running"), "{err}");
    let err = collect_garbage(&remote, &now)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("another garbage collection"), "{err}");
    remote.object_store().delete(&lock).await.unwrap();
    remote
        .push(&a, &chain.heads[2], None, &NoProgress)
        .await
        .unwrap();
}

#[tokio::test]
async fn cache_gc_removes_unreferenced_objects_and_stale_images() {
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("c")).unwrap();
    let chain = build_chain(&cache, dir.path(), 1024, 300, 50);
    let image = assemble(&cache, &chain.heads[2]).unwrap();
    // Drop the head manifest: its own objects and its image become garbage.
    std::fs::remove_file(cache.layer_path(&chain.heads[2])).unwrap();
    let opts = GcOptions {
        min_age: Duration::ZERO,
        ..Default::default()
    };
    let (report, images) = collect_cache_garbage(&cache, &opts).await.unwrap();
    assert!(report.objects_deleted >= 2, "{report:?}"); // diff chunk(s) + state
    assert_eq!(images, 1);
    assert!(!image.exists());
    assert_same_file(
        &assemble(&cache, &chain.heads[1]).unwrap(),
        &chain.memories[1],
    );
}

/// What a store holds under a tag or a layer's name is bounded by what it can be: a huge
/// object there is refused on its declared size, unread, with a typed error.
#[tokio::test]
async fn oversized_tags_and_manifests_are_refused_unread() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let remote = RemoteStore::open_local(&store).unwrap();
    let tag = store.join(tine_snapshot_store::cache::tag_key("huge"));
    std::fs::create_dir_all(tag.parent().unwrap()).unwrap();
    let f = std::fs::File::create(&tag).unwrap();
    f.set_len(8 << 30).unwrap(); // sparse: 8 GiB declared, nothing stored
    let err = remote.get_tag("huge").await.unwrap_err();
    println!("{err}");
    assert!(
        matches!(
            err,
            tine_snapshot_store::error::StoreError::TooLarge { size, .. } if size == 8 << 30
        ),
        "{err:?}"
    );
    let d = tine_snapshot_store::digest::Digest::of(b"some layer");
    let layer = store.join(tine_snapshot_store::cache::layer_key(&d));
    std::fs::create_dir_all(layer.parent().unwrap()).unwrap();
    std::fs::File::create(&layer)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    let err = remote.get_layer(&d).await.unwrap_err();
    assert!(
        matches!(err, tine_snapshot_store::error::StoreError::TooLarge { .. }),
        "{err:?}"
    );
}
