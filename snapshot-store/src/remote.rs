//! The shared store behind `object_store`: a local directory (embedded
//! mode) or an S3-compatible bucket. Same key layout as the cache:
//! `chunks/ab/<hex>`, `layers/<hex>`, `tags/<tag>`, plus `locks/` for GC.
//!
//! Invariant: a manifest is uploaded only after all its objects and its
//! parent manifest are present, so "layer X exists remotely" implies its whole
//! chain is there, and a push can skip everything below a layer it finds.
//!
//! Reachability: every operation is bounded (S3 connect and request timeouts,
//! object_store's per-request retries, then [`RetryPolicy`] with its hard
//! `max_elapsed`); when transient failures outlast all of it the caller gets
//! [`StoreError::Unavailable`] naming the store and the operation.

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::AmazonS3ConfigKey;
use object_store::path::Path as ObjPath;
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreExt, PutMode, PutOptions};

use crate::cache::{layer_key, object_key, parse_tag_value, tag_key, LocalCache, TAGS_DIR};
use crate::digest::Digest;
use crate::error::{Result, StoreError};
use crate::gc::PushLease;
use crate::manifest::{pb, Layer, MAX_MANIFEST_BYTES};
use crate::progress::{Progress, ProgressEvent};
use crate::retry::{is_transient, Failure, RetryPolicy};
use crate::tag::validate_tag;

/// Connection settings for an S3-compatible store.
#[derive(Debug, Clone, Default)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix inside the bucket ("" = bucket root).
    pub prefix: String,
    /// e.g. `http://127.0.0.1:9000`; None = AWS.
    pub endpoint: Option<String>,
    pub region: Option<String>,
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<String>,
    pub allow_http: bool,
    pub limits: S3ClientLimits,
}

/// Per-request bounds of the S3 client. The whole operation around these
/// requests is bounded again by [`RetryPolicy::max_elapsed`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3ClientLimits {
    /// TCP + TLS handshake.
    pub connect_timeout: Duration,
    /// One request, from connecting until the body has been read.
    pub request_timeout: Duration,
    /// object_store's own retries of one request (connect errors, 5xx, 429).
    pub request_retries: usize,
    /// object_store stops retrying a request after this long.
    pub request_retry_timeout: Duration,
}

impl Default for S3ClientLimits {
    fn default() -> Self {
        // 3 s to connect is AWS's own recommendation (3.1 s) for latency-
        // sensitive clients; 30 s per request leaves a 5 MiB chunk room on a
        // slow link. Two quick request-level retries absorb a blip (a 503
        // SlowDown, a reset connection) before the whole-operation retries.
        S3ClientLimits {
            connect_timeout: Duration::from_secs(3),
            request_timeout: Duration::from_secs(30),
            request_retries: 2,
            request_retry_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TransferOptions {
    /// Object transfers in flight at once.
    pub concurrency: usize,
    /// Whole-operation retries and the hard time budget of each operation.
    pub retry: RetryPolicy,
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            concurrency: 8,
            retry: RetryPolicy::default(),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TransferSummary {
    pub layers_transferred: u64,
    pub objects_transferred: u64,
    pub objects_skipped: u64,
    pub bytes_transferred: u64,
}

#[derive(Clone)]
pub struct RemoteStore {
    store: Arc<dyn ObjectStore>,
    description: String,
    opts: TransferOptions,
    /// For a directory store: the directory, checked before every operation
    /// (LocalFileSystem answers "not found" for everything once it is gone,
    /// and would quietly recreate it on the next put).
    local_root: Option<PathBuf>,
}

impl std::fmt::Debug for RemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.description)
    }
}

/// rustls needs a process-wide crypto provider; we ship ring (no C build of
/// aws-lc). Installing twice is harmless.
fn install_tls_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

impl RemoteStore {
    pub fn from_object_store(store: Arc<dyn ObjectStore>, description: impl Into<String>) -> Self {
        RemoteStore {
            store,
            description: description.into(),
            opts: TransferOptions::default(),
            local_root: None,
        }
    }

    pub fn with_options(mut self, opts: TransferOptions) -> Self {
        self.opts = opts;
        self
    }

    /// A directory used as the store (created if missing).
    pub fn open_local(dir: &std::path::Path) -> Result<Self> {
        crate::fsutil::create_dir_all(dir)?;
        let fs = object_store::local::LocalFileSystem::new_with_prefix(dir)
            .map_err(|e| StoreError::RemoteConfig(format!("{}: {e}", dir.display())))?;
        let mut store = Self::from_object_store(Arc::new(fs), format!("dir {}", dir.display()));
        store.local_root = Some(dir.to_path_buf());
        Ok(store)
    }

    pub fn open_s3(cfg: &S3Config) -> Result<Self> {
        install_tls_provider();
        let lim = &cfg.limits;
        // Explicit limits win over any AWS_* client settings from the environment.
        let ms = |d: Duration| format!("{}ms", d.as_millis());
        let mut b = object_store::aws::AmazonS3Builder::from_env()
            .with_bucket_name(&cfg.bucket)
            .with_allow_http(cfg.allow_http)
            .with_config(
                AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                ms(lim.connect_timeout),
            )
            .with_config(
                AmazonS3ConfigKey::Client(ClientConfigKey::Timeout),
                ms(lim.request_timeout),
            )
            .with_retry(object_store::RetryConfig {
                max_retries: lim.request_retries,
                retry_timeout: lim.request_retry_timeout,
                backoff: object_store::BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(1),
                    base: 2.0,
                },
            });
        if let Some(e) = &cfg.endpoint {
            b = b.with_endpoint(e);
        }
        if let Some(r) = &cfg.region {
            b = b.with_region(r);
        }
        if let Some(k) = &cfg.access_key_id {
            b = b.with_access_key_id(k);
        }
        if let Some(s) = &cfg.secret_access_key {
            b = b.with_secret_access_key(s);
        }
        let s3 = b
            .build()
            .map_err(|e| StoreError::RemoteConfig(format!("s3 bucket {}: {e}", cfg.bucket)))?;
        let mut desc = format!("s3://{}", cfg.bucket);
        if !cfg.prefix.is_empty() {
            desc = format!("{desc}/{}", cfg.prefix);
        }
        if let Some(e) = &cfg.endpoint {
            desc = format!("{desc} at {e}");
        }
        let store: Arc<dyn ObjectStore> = if cfg.prefix.is_empty() {
            Arc::new(s3)
        } else {
            Arc::new(object_store::prefix::PrefixStore::new(
                s3,
                cfg.prefix.as_str(),
            ))
        };
        Ok(Self::from_object_store(store, desc))
    }

    /// `s3://bucket[/prefix]` (endpoint, region and credentials from the
    /// usual AWS_* variables, e.g. AWS_ENDPOINT_URL, AWS_ALLOW_HTTP=true),
    /// `file:///dir`, or a plain directory path.
    pub fn open_url(url: &str) -> Result<Self> {
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(StoreError::RemoteConfig(format!(
                    "{url}: missing bucket name"
                )));
            }
            let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
            let endpoint = env("AWS_ENDPOINT_URL").or_else(|| env("AWS_ENDPOINT"));
            let allow_http = env("AWS_ALLOW_HTTP").is_some_and(|v| v == "true" || v == "1")
                || endpoint
                    .as_deref()
                    .is_some_and(|e| e.starts_with("http://"));
            return Self::open_s3(&S3Config {
                bucket: bucket.to_string(),
                prefix: prefix.trim_end_matches('/').to_string(),
                endpoint,
                allow_http,
                ..Default::default()
            });
        }
        if let Some(path) = url.strip_prefix("file://") {
            return Self::open_local(std::path::Path::new(path));
        }
        if url.contains("://") {
            return Err(StoreError::RemoteConfig(format!(
                "{url}: unsupported scheme (use s3:// or a directory)"
            )));
        }
        Self::open_local(std::path::Path::new(url))
    }

    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    pub fn description(&self) -> &str {
        &self.description
    }

    pub fn options(&self) -> &TransferOptions {
        &self.opts
    }

    /// Transient failures that outlasted the retries mean the store is
    /// unreachable; anything else is the store's answer to this request.
    fn fail(&self, op: &'static str, key: &str, f: Failure) -> StoreError {
        if is_transient(&f.error) {
            StoreError::Unavailable {
                store: self.description.clone(),
                what: format!("{op} {key}"),
                attempts: f.attempts,
                elapsed: f.elapsed,
                reason: error_chain(&f.error),
            }
        } else {
            StoreError::Remote {
                op,
                key: key.to_string(),
                source: f.error,
            }
        }
    }

    /// One store operation under the retry policy.
    async fn run<T, F, Fut>(&self, op: &'static str, mut f: F) -> Result<T, Failure>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = object_store::Result<T>>,
    {
        self.opts
            .retry
            .run(op, || {
                let root = self.local_root.clone();
                let fut = f();
                async move {
                    if let Some(root) = root {
                        check_store_dir(root).await?;
                    }
                    fut.await
                }
            })
            .await
    }

    pub(crate) async fn exists(&self, key: &str) -> Result<bool> {
        let path = ObjPath::from(key);
        match self.run("head", || self.store.head(&path)).await {
            Ok(_) => Ok(true),
            Err(f) if self.no_bucket(&f) => Err(self.missing_bucket()),
            Err(Failure {
                error: object_store::Error::NotFound { .. },
                ..
            }) => Ok(false),
            Err(f) => Err(self.fail("head", key, f)),
        }
    }

    /// The bytes under `key` (None: absent), which may be at most `max`: a larger object is
    /// refused on the size its response declares, before its body is read. The whole GET,
    /// body included, is one retry unit.
    pub(crate) async fn get_bounded(&self, key: &str, max: u64) -> Result<Option<Bytes>> {
        let path = ObjPath::from(key);
        let r = self
            .run("get", || async {
                let got = self.store.get(&path).await?;
                if got.meta.size > max {
                    // Dropping the response drops its unread body.
                    return Ok(Err(got.meta.size));
                }
                got.bytes().await.map(Ok)
            })
            .await;
        let too_large = |size: u64| StoreError::TooLarge {
            key: key.to_string(),
            size,
            max,
        };
        match r {
            Ok(Ok(b)) if b.len() as u64 <= max => Ok(Some(b)),
            // A body longer than its declared size.
            Ok(Ok(b)) => Err(too_large(b.len() as u64)),
            Ok(Err(size)) => Err(too_large(size)),
            Err(f) if self.no_bucket(&f) => Err(self.missing_bucket()),
            Err(Failure {
                error: object_store::Error::NotFound { .. },
                ..
            }) => Ok(None),
            Err(f) => Err(self.fail("get", key, f)),
        }
    }

    /// S3 answers 404 both for a missing key and for a missing bucket: only its error code
    /// (in the body object_store keeps) tells them apart.
    fn no_bucket(&self, f: &Failure) -> bool {
        matches!(f.error, object_store::Error::NotFound { .. })
            && error_chain(&f.error).contains("NoSuchBucket")
    }

    fn missing_bucket(&self) -> StoreError {
        StoreError::RemoteConfig(format!(
            "{}: the bucket does not exist (create it, or fix the bucket name)",
            self.description
        ))
    }

    /// Create-only put: an existing object under a content-addressed key is
    /// by definition identical, so AlreadyExists is success.
    pub(crate) async fn put_if_absent(&self, key: &str, data: Bytes) -> Result<bool> {
        let path = ObjPath::from(key);
        let r = self
            .run("put", || {
                self.store.put_opts(
                    &path,
                    data.clone().into(),
                    PutOptions::from(PutMode::Create),
                )
            })
            .await;
        match r {
            Ok(_) => Ok(true),
            Err(Failure {
                error: object_store::Error::AlreadyExists { .. },
                ..
            }) => Ok(false),
            Err(f) => Err(self.fail("put", key, f)),
        }
    }

    pub(crate) async fn put_overwrite(&self, key: &str, data: Bytes) -> Result<()> {
        let path = ObjPath::from(key);
        self.run("put", || {
            self.store.put_opts(
                &path,
                data.clone().into(),
                PutOptions::from(PutMode::Overwrite),
            )
        })
        .await
        .map(|_| ())
        .map_err(|f| self.fail("put", key, f))
    }

    pub(crate) async fn delete(&self, key: &str) -> Result<()> {
        let path = ObjPath::from(key);
        match self.run("delete", || self.store.delete(&path)).await {
            Ok(())
            | Err(Failure {
                error: object_store::Error::NotFound { .. },
                ..
            }) => Ok(()),
            Err(f) => Err(self.fail("delete", key, f)),
        }
    }

    pub(crate) async fn list(&self, prefix: &str) -> Result<Vec<object_store::ObjectMeta>> {
        let p = ObjPath::from(prefix);
        self.run("list", || self.store.list(Some(&p)).try_collect::<Vec<_>>())
            .await
            .map_err(|f| self.fail("list", prefix, f))
    }

    pub async fn get_layer(&self, d: &Digest) -> Result<Layer> {
        let key = layer_key(d);
        let bytes = self
            .get_bounded(&key, MAX_MANIFEST_BYTES as u64)
            .await?
            .ok_or(StoreError::RemoteLayerMissing(*d))?;
        Layer::decode_verified(*d, bytes.to_vec())
    }

    /// One object's stored bytes, not yet verified (verify on ingest, e.g.
    /// with [`LocalCache::put_object_verified`]); None when the store lacks
    /// it. `stored_len` is what its (verified) layer says it holds: a larger
    /// object is refused on its declared size, before its body is read.
    /// Failures are typed like every other operation's, Unavailable included.
    pub async fn get_object(&self, d: &Digest, stored_len: u64) -> Result<Option<Bytes>> {
        self.get_bounded(&object_key(d), stored_len).await
    }

    pub async fn has_layer(&self, d: &Digest) -> Result<bool> {
        self.exists(&layer_key(d)).await
    }

    pub async fn get_tag(&self, tag: &str) -> Result<Digest> {
        validate_tag(tag)?;
        // A digest in hex and a newline; anything much larger is not a tag.
        match self.get_bounded(&tag_key(tag), 4096).await? {
            Some(b) => parse_tag_value(tag, &b),
            None => Err(StoreError::UnknownTag(tag.to_string())),
        }
    }

    pub async fn set_tag(&self, tag: &str, head: &Digest) -> Result<()> {
        validate_tag(tag)?;
        self.put_overwrite(&tag_key(tag), Bytes::from(format!("{}\n", head.hex())))
            .await
    }

    /// Remove a tag (absent already is fine). Its layers go at the next garbage collection
    /// with `prune_untagged`, once no other tag's chain uses them.
    pub async fn remove_tag(&self, tag: &str) -> Result<()> {
        validate_tag(tag)?;
        self.delete(&tag_key(tag)).await
    }

    pub async fn list_tags(&self) -> Result<Vec<(String, Digest)>> {
        let mut out = Vec::new();
        for meta in self.list(TAGS_DIR).await? {
            let Some(name) = meta.location.filename().map(str::to_owned) else {
                continue;
            };
            if validate_tag(&name).is_ok() {
                if let Ok(d) = self.get_tag(&name).await {
                    out.push((name, d));
                }
            }
        }
        out.sort();
        Ok(out)
    }

    /// Resolves a tag (remote first, then the cache's) or a digest.
    pub async fn resolve(&self, cache: &LocalCache, tag_or_digest: &str) -> Result<Digest> {
        if let Ok(d) = Digest::parse(tag_or_digest) {
            return Ok(d);
        }
        match self.get_tag(tag_or_digest).await {
            Err(StoreError::UnknownTag(_)) => cache.get_tag(tag_or_digest),
            r => r,
        }
    }

    /// Uploads the chain of `head` (and points `tag` at it when given).
    pub async fn push(
        &self,
        cache: &LocalCache,
        head: &Digest,
        tag: Option<&str>,
        progress: &dyn Progress,
    ) -> Result<TransferSummary> {
        if let Some(t) = tag {
            validate_tag(t)?;
        }
        // Eviction waits until the chain has been read and uploaded.
        let _lock = lock_shared(cache).await?;
        let chain = cache.chain(head)?;
        let lease = PushLease::acquire(self).await?;
        let result = self.push_chain(cache, &chain, progress).await;
        let result = match (result, tag) {
            (Ok(s), Some(t)) => self.set_tag(t, head).await.map(|()| s),
            (r, _) => r,
        };
        lease.release(self).await;
        result
    }

    async fn push_chain(
        &self,
        cache: &LocalCache,
        chain: &[Layer],
        progress: &dyn Progress,
    ) -> Result<TransferSummary> {
        // Layers already present remotely carry their whole chain (invariant).
        let mut missing = Vec::new();
        for layer in chain {
            if self.has_layer(&layer.digest).await? {
                break;
            }
            missing.push(layer);
        }
        missing.reverse(); // base first
        let mut objects: Vec<&pb::ObjectRef> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for l in &missing {
            for o in l.object_refs() {
                if seen.insert(o.hash.clone()) {
                    objects.push(o);
                }
            }
        }
        let counters = Counters::new("push", &objects);
        // try_collect stops at the first failure: with an unreachable store,
        // waiting for every remaining object to time out too would multiply
        // the bounded failure time by the object count. Dropping an upload in
        // flight is safe: puts are atomic, and no manifest follows.
        futures::stream::iter(objects.iter().map(|o| {
            let counters = &counters;
            async move {
                let d = Digest::from_bytes(&o.hash)?;
                let key = object_key(&d);
                // A HEAD is cheaper than uploading megabytes to learn it exists.
                if self.exists(&key).await? {
                    counters.skipped(progress);
                    return Ok(());
                }
                let path = cache.object_path(&d);
                let data = tokio::fs::read(&path)
                    .await
                    .map_err(StoreError::io("read object for push", &path))?;
                let len = data.len() as u64;
                if self.put_if_absent(&key, Bytes::from(data)).await? {
                    counters.done(len, progress);
                } else {
                    counters.skipped(progress);
                }
                Ok(())
            }
        }))
        .buffer_unordered(self.opts.concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;
        for l in &missing {
            self.put_if_absent(&layer_key(&l.digest), Bytes::from(l.bytes.clone()))
                .await?;
        }
        Ok(counters.summary(missing.len() as u64))
    }

    /// Downloads what the cache lacks of the chain named by a tag or digest;
    /// every object is verified as it enters the cache. Returns the head.
    pub async fn pull(
        &self,
        cache: &LocalCache,
        tag_or_digest: &str,
        progress: &dyn Progress,
    ) -> Result<(Digest, TransferSummary)> {
        let by_tag = Digest::parse(tag_or_digest).is_err();
        let head = if by_tag {
            self.get_tag(tag_or_digest).await?
        } else {
            Digest::parse(tag_or_digest)?
        };
        let summary = self.pull_head(cache, &head, progress).await?;
        if by_tag {
            cache.set_tag(tag_or_digest, &head)?;
        }
        Ok((head, summary))
    }

    pub async fn pull_head(
        &self,
        cache: &LocalCache,
        head: &Digest,
        progress: &dyn Progress,
    ) -> Result<TransferSummary> {
        // Held for the whole pull: eviction must not remove an object this
        // pull counted as present before its manifest lands.
        let _lock = lock_shared(cache).await?;
        let mut chain = Vec::new();
        let mut fetched = Vec::new();
        let mut next = Some(*head);
        while let Some(d) = next {
            let layer = if cache.has_layer(&d) {
                cache.read_layer(&d)?
            } else {
                let l = self.get_layer(&d).await?;
                fetched.push(l.digest);
                l
            };
            if let Some(child) = chain.last() {
                crate::cache::check_link(child, &layer)?;
            }
            next = layer.parent();
            chain.push(layer);
        }
        let mut objects: Vec<&pb::ObjectRef> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for l in &chain {
            for o in l.object_refs() {
                if seen.insert(o.hash.clone()) {
                    objects.push(o);
                }
            }
        }
        let counters = Counters::new("pull", &objects);
        // Objects this pull added, removed again if the pull fails so a
        // refused pull leaves the cache as it found it.
        let added = std::sync::Mutex::new(Vec::new());
        // After the first failure, objects not yet started are skipped (an
        // unreachable store must not cost one timeout per object), but the
        // ones in flight are awaited, so the rollback below sees every object
        // this pull wrote.
        let failed = AtomicBool::new(false);
        let results: Vec<Result<()>> = futures::stream::iter(objects.iter().map(|o| {
            let counters = &counters;
            let added = &added;
            let failed = &failed;
            async move {
                if failed.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let r = self.pull_object(cache, o, added, counters, progress).await;
                if r.is_err() {
                    failed.store(true, Ordering::Relaxed);
                }
                r
            }
        }))
        .buffer_unordered(self.opts.concurrency.max(1))
        .collect()
        .await;
        if let Err(e) = results.into_iter().collect::<Result<Vec<()>>>() {
            for d in added.lock().expect("added list").iter() {
                let _ = std::fs::remove_file(cache.object_path(d));
            }
            return Err(e);
        }
        // Manifests last, base first: a cached manifest implies its objects
        // and its parent, so a pull killed at any point leaves either
        // complete chains or objects no manifest names yet.
        for l in chain.iter().rev() {
            cache.put_layer(l)?;
        }
        Ok(counters.summary(fetched.len() as u64))
    }

    /// Downloads one object into the cache unless it is there already.
    async fn pull_object(
        &self,
        cache: &LocalCache,
        o: &pb::ObjectRef,
        added: &std::sync::Mutex<Vec<Digest>>,
        counters: &Counters,
        progress: &dyn Progress,
    ) -> Result<()> {
        let d = Digest::from_bytes(&o.hash)?;
        if cache.has_object(&d) {
            counters.skipped(progress);
            return Ok(());
        }
        let key = object_key(&d);
        let data = self.get_bounded(&key, o.stored_len).await?.ok_or_else(|| {
            StoreError::CorruptObject {
                digest: d,
                reason: "missing from the remote store".into(),
            }
        })?;
        if data.len() as u64 != o.stored_len {
            return Err(StoreError::CorruptObject {
                digest: d,
                reason: format!(
                    "remote object is {} bytes, manifest says {}",
                    data.len(),
                    o.stored_len
                ),
            });
        }
        let len = data.len() as u64;
        let cache = cache.clone();
        tokio::task::spawn_blocking(move || cache.put_object_verified(&d, &data))
            .await
            .map_err(|e| StoreError::InvalidInput(format!("verify task failed: {e}")))??;
        added.lock().expect("added list").push(d);
        counters.done(len, progress);
        Ok(())
    }
}

/// A directory store whose directory vanished or cannot be read is
/// unreachable: a transient Generic error, since an unmounted share may come
/// back. Off the async threads and inside the attempt, so a hung mount is cut
/// off by the operation's budget like a silent server.
async fn check_store_dir(root: PathBuf) -> object_store::Result<()> {
    let generic = |msg: String| object_store::Error::Generic {
        store: "LocalFileSystem",
        source: msg.into(),
    };
    tokio::task::spawn_blocking(move || {
        std::fs::read_dir(&root)
            .map(drop)
            .map_err(|e| generic(format!("store directory {}: {e}", root.display())))
    })
    .await
    .map_err(|e| generic(format!("store directory check failed: {e}")))?
}

/// The cache's shared lock, taken off the async threads: it waits while an
/// eviction runs.
async fn lock_shared(cache: &LocalCache) -> Result<crate::cache::CacheLock> {
    let c = cache.clone();
    tokio::task::spawn_blocking(move || c.lock_shared())
        .await
        .map_err(|e| StoreError::InvalidInput(format!("cache lock task failed: {e}")))?
}

/// An error and its sources on one line: the top of an object_store error
/// says "error sending request", the cause ("Connection refused") is below.
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let text = s.to_string();
        if !out.contains(&text) {
            out = format!("{out}: {text}");
        }
        cur = s.source();
    }
    out
}

struct Counters {
    phase: &'static str,
    total_objects: u64,
    total_bytes: u64,
    done_objects: AtomicU64,
    done_bytes: AtomicU64,
    skipped: AtomicU64,
}

impl Counters {
    fn new(phase: &'static str, objects: &[&pb::ObjectRef]) -> Self {
        Counters {
            phase,
            total_objects: objects.len() as u64,
            total_bytes: objects.iter().map(|o| o.stored_len).sum(),
            done_objects: AtomicU64::new(0),
            done_bytes: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
        }
    }
    fn event(&self) -> ProgressEvent {
        ProgressEvent {
            phase: self.phase,
            done_objects: self.done_objects.load(Ordering::Relaxed),
            total_objects: self.total_objects,
            done_bytes: self.done_bytes.load(Ordering::Relaxed),
            total_bytes: self.total_bytes,
            skipped_objects: self.skipped.load(Ordering::Relaxed),
        }
    }
    fn done(&self, bytes: u64, p: &dyn Progress) {
        self.done_bytes.fetch_add(bytes, Ordering::Relaxed);
        self.done_objects.fetch_add(1, Ordering::Relaxed);
        p.update(&self.event());
    }
    fn skipped(&self, p: &dyn Progress) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
        p.update(&self.event());
    }
    fn summary(&self, layers: u64) -> TransferSummary {
        let e = self.event();
        TransferSummary {
            layers_transferred: layers,
            objects_transferred: e.done_objects,
            objects_skipped: e.skipped_objects,
            bytes_transferred: e.done_bytes,
        }
    }
}
