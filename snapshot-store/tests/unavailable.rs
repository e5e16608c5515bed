//! A store that cannot be reached fails with `StoreError::Unavailable`, naming
//! the store and the operation, within a bounded time; a store that answers
//! "no" (4xx) or serves corrupt data is never reported as unavailable.
//!
//! The endpoints are real sockets: a closed loopback port (connection
//! refused), a listener that never accepts (connect succeeds, no answer), and
//! a minimal HTTP server that answers every request with one fixed status.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use tine_snapshot_store::cache::{object_key, LocalCache};
use tine_snapshot_store::progress::NoProgress;
use tine_snapshot_store::remote::{RemoteStore, S3ClientLimits, S3Config, TransferOptions};
use tine_snapshot_store::retry::RetryPolicy;
use tine_snapshot_store::{Digest, StoreError};

const BUCKET: &str = "tine-unreachable";

fn s3_at(endpoint: &str, limits: S3ClientLimits) -> RemoteStore {
    RemoteStore::open_s3(&S3Config {
        bucket: BUCKET.into(),
        prefix: "snaps".into(),
        endpoint: Some(endpoint.into()),
        region: Some("us-east-1".into()),
        access_key_id: Some("testing".into()),
        secret_access_key: Some("testing".into()),
        allow_http: true,
        limits,
    })
    .unwrap()
}

/// Fast limits so a test spends milliseconds, not the production budget.
fn quick_limits() -> S3ClientLimits {
    S3ClientLimits {
        connect_timeout: Duration::from_secs(1),
        request_timeout: Duration::from_secs(2),
        request_retries: 1,
        request_retry_timeout: Duration::from_secs(2),
    }
}

fn quick_retry(max_attempts: u32) -> TransferOptions {
    TransferOptions {
        concurrency: 4,
        retry: RetryPolicy {
            max_attempts,
            initial_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_millis(50),
            max_elapsed: Duration::from_secs(10),
        },
    }
}

/// A loopback port nothing listens on: connections are refused at once.
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

/// Destructures an Unavailable error, failing the test on anything else.
fn unavailable(e: StoreError) -> (String, String, u32, Duration, String) {
    let text = e.to_string();
    match e {
        StoreError::Unavailable {
            store,
            what,
            attempts,
            elapsed,
            reason,
        } => {
            assert!(text.contains(&store) && text.contains(&what), "{text}");
            (store, what, attempts, elapsed, reason)
        }
        other => panic!("expected Unavailable, got {other:?}: {other}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_port_is_unavailable_naming_the_store_and_the_operation() {
    let port = closed_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let remote = s3_at(&endpoint, quick_limits()).with_options(quick_retry(3));
    let dir = tempfile::tempdir().unwrap();
    let cache = LocalCache::open(dir.path().join("cache")).unwrap();
    let head = Digest::of(b"some head");

    let t = Instant::now();
    let err = remote
        .pull_head(&cache, &head, &NoProgress)
        .await
        .unwrap_err();
    let took = t.elapsed();
    println!("pull_head against {endpoint}: {took:?}: {err}");
    assert!(err.is_unavailable());
    let (store, what, attempts, elapsed, reason) = unavailable(err);
    assert!(
        store.contains(BUCKET) && store.contains(&format!("127.0.0.1:{port}")),
        "{store}"
    );
    assert_eq!(what, format!("get layers/{}", head.hex()));
    assert_eq!(attempts, 3);
    assert!(elapsed <= took && took < Duration::from_secs(5), "{took:?}");
    assert!(reason.contains(&format!("127.0.0.1:{port}")), "{reason}");
    assert!(reason.contains("Connection refused"), "{reason}");

    let err = remote.get_layer(&head).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    let err = remote.get_object(&head, 1 << 20).await.unwrap_err();
    let (_, what, ..) = unavailable(err);
    assert_eq!(what, format!("get {}", object_key(&head)));
    // Not "unknown tag": an unreachable store says nothing about the tag.
    let err = remote
        .pull(&cache, "py3.12", &NoProgress)
        .await
        .unwrap_err();
    let (_, what, ..) = unavailable(err);
    assert_eq!(what, "get tags/py3.12");

    // A push fails the same way, and nothing was half-written to the cache.
    let chain = build_chain(&cache, dir.path(), 256, 40, 8);
    let t = Instant::now();
    let err = remote
        .push(&cache, &chain.heads[2], Some("t"), &NoProgress)
        .await
        .unwrap_err();
    println!("push against {endpoint}: {:?}: {err}", t.elapsed());
    let (_, what, ..) = unavailable(err);
    assert!(what.starts_with("put locks/push-"), "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_limits_are_bounded_and_hold_against_a_closed_port() {
    // The configuration a host gets from open_url: read it, then use it.
    let limits = S3ClientLimits::default();
    let opts = TransferOptions::default();
    println!("defaults: {limits:?}, {opts:?}");
    assert!(limits.connect_timeout <= Duration::from_secs(3));
    assert!(limits.request_timeout <= Duration::from_secs(30));
    assert!(limits.request_retries <= 3);
    assert!(limits.request_retry_timeout <= Duration::from_secs(10));
    assert!(opts.retry.max_attempts <= 5);
    assert!(opts.retry.max_elapsed <= Duration::from_secs(30));

    let endpoint = format!("http://127.0.0.1:{}", closed_port());
    let remote = s3_at(&endpoint, limits);
    let t = Instant::now();
    let err = remote.get_layer(&Digest::of(b"x")).await.unwrap_err();
    let took = t.elapsed();
    let (_, _, attempts, ..) = unavailable(err);
    println!("defaults against a closed port: {attempts} attempts in {took:?}");
    assert_eq!(attempts, opts.retry.max_attempts);
    assert!(took <= opts.retry.max_elapsed, "{took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_endpoint_is_cut_off_by_the_request_timeout_and_by_the_budget() {
    // Bound but never accepting: the kernel completes the handshake, then
    // nothing ever answers. The listener must live for the whole test.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", silent.local_addr().unwrap());

    // The request timeout ends each attempt.
    let remote = s3_at(
        &endpoint,
        S3ClientLimits {
            request_timeout: Duration::from_millis(300),
            request_retries: 0,
            ..quick_limits()
        },
    )
    .with_options(quick_retry(2));
    let t = Instant::now();
    let err = remote.get_layer(&Digest::of(b"x")).await.unwrap_err();
    let took = t.elapsed();
    let (_, _, attempts, _, reason) = unavailable(err);
    println!("silent endpoint, 300 ms request timeout: {attempts} attempts in {took:?}: {reason}");
    assert_eq!(attempts, 2);
    assert!(reason.contains("timed out"), "{reason}");
    assert!(
        took >= Duration::from_millis(600) && took < Duration::from_secs(3),
        "{took:?}"
    );

    // With the production request timeout (30 s), the operation's own budget
    // is what ends it.
    let mut opts = quick_retry(5);
    opts.retry.max_elapsed = Duration::from_secs(1);
    let remote = s3_at(&endpoint, S3ClientLimits::default()).with_options(opts);
    let t = Instant::now();
    let err = remote.get_layer(&Digest::of(b"x")).await.unwrap_err();
    let took = t.elapsed();
    let (_, _, attempts, _, reason) = unavailable(err);
    println!("silent endpoint, 1 s budget: {attempts} attempt(s) in {took:?}: {reason}");
    assert_eq!(attempts, 1);
    assert!(reason.contains("budget"), "{reason}");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(3),
        "{took:?}"
    );
    drop(silent);
}

/// Answers every HTTP request with `status` (e.g. "503 Service Unavailable")
/// and counts the requests.
fn fixed_status_server(status: &'static str) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let count = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&count);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let counter = Arc::clone(&counter);
            std::thread::spawn(move || serve(conn, status, &counter));
        }
    });
    (endpoint, count)
}

fn serve(conn: TcpStream, status: &str, count: &AtomicUsize) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    loop {
        let mut content_length = 0usize;
        let mut line = String::new();
        // Request line and headers.
        let mut first = true;
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line == "\r\n" {
                break;
            }
            if first {
                first = false;
                continue;
            }
            if let Some((k, v)) = line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    content_length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; content_length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        count.fetch_add(1, Ordering::SeqCst);
        let reply = "<Error><Code>Test</Code><Message>fixed status</Message></Error>";
        let _ = write!(
            conn,
            "HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\r\n{reply}",
            reply.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_errors_make_it_unavailable_but_client_errors_do_not() {
    let head = Digest::of(b"x");

    // 503 on every request: each whole-operation attempt is 1 + 1 request
    // retries, 3 attempts, then Unavailable.
    let (endpoint, requests) = fixed_status_server("503 Service Unavailable");
    let remote = s3_at(&endpoint, quick_limits()).with_options(quick_retry(3));
    let t = Instant::now();
    let err = remote.get_layer(&head).await.unwrap_err();
    let (_, _, attempts, _, reason) = unavailable(err);
    println!(
        "503 server: {attempts} attempts, {} requests in {:?}: {reason}",
        requests.load(Ordering::SeqCst),
        t.elapsed()
    );
    assert_eq!(attempts, 3);
    assert_eq!(requests.load(Ordering::SeqCst), 6);
    assert!(reason.contains("503"), "{reason}");

    // 400 and 403 are the store's answer to a bad request: reported as such,
    // at once, without retries at either level.
    for status in ["400 Bad Request", "403 Forbidden"] {
        let (endpoint, requests) = fixed_status_server(status);
        let remote = s3_at(&endpoint, quick_limits()).with_options(quick_retry(3));
        let err = remote.get_layer(&head).await.unwrap_err();
        println!("{status} server: {err}");
        assert!(!err.is_unavailable(), "{err}");
        assert!(
            matches!(err, StoreError::Remote { op: "get", .. }),
            "{err:?}"
        );
        assert!(err.to_string().contains(&status[..3]), "{err}");
        assert_eq!(requests.load(Ordering::SeqCst), 1, "{status} was retried");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directory_store_that_vanished_is_unavailable_and_not_recreated() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let remote = RemoteStore::open_local(&store_dir)
        .unwrap()
        .with_options(quick_retry(3));
    let a = LocalCache::open(dir.path().join("a")).unwrap();
    let chain = build_chain(&a, dir.path(), 512, 100, 20);
    let head = chain.heads[2];
    remote
        .push(&a, &head, Some("top"), &NoProgress)
        .await
        .unwrap();

    // Gone (an unmounted share, a deleted directory).
    let aside = dir.path().join("aside");
    std::fs::rename(&store_dir, &aside).unwrap();
    let b = LocalCache::open(dir.path().join("b")).unwrap();
    let err = remote.pull_head(&b, &head, &NoProgress).await.unwrap_err();
    println!("vanished directory: {err}");
    let (store, what, attempts, _, reason) = unavailable(err);
    assert_eq!(store, format!("dir {}", store_dir.display()));
    assert_eq!(what, format!("get layers/{}", head.hex()));
    assert_eq!(attempts, 3);
    assert!(reason.contains("No such file"), "{reason}");
    let err = remote.push(&a, &head, None, &NoProgress).await.unwrap_err();
    assert!(err.is_unavailable(), "{err}");
    assert!(
        !store_dir.exists(),
        "a push must not recreate a vanished store directory"
    );

    // Replaced by something that is not a directory.
    std::fs::write(&store_dir, b"not a directory").unwrap();
    let err = remote.get_tag("top").await.unwrap_err();
    let (.., reason) = unavailable(err);
    assert!(reason.contains("Not a directory"), "{reason}");

    // Back again: the same store object works, so callers may simply retry.
    std::fs::remove_file(&store_dir).unwrap();
    std::fs::rename(&aside, &store_dir).unwrap();
    let d = a.read_layer(&head).unwrap().chunk_digest(0);
    let bytes = remote.get_object(&d, u64::MAX).await.unwrap().unwrap();
    assert_eq!(Digest::of(&bytes), d);
    // Bounded by the length its layer gives: a larger object is refused, not read.
    let len = bytes.len() as u64;
    assert_eq!(
        remote.get_object(&d, len).await.unwrap().unwrap().len() as u64,
        len
    );
    let err = remote.get_object(&d, len - 1).await.unwrap_err();
    assert!(matches!(err, StoreError::TooLarge { .. }), "{err}");
    assert!(remote
        .get_object(&Digest::of(b"absent"), 1 << 20)
        .await
        .unwrap()
        .is_none());
    remote.pull_head(&b, &head, &NoProgress).await.unwrap();
    assert_same_file(
        &tine_snapshot_store::assemble::assemble(&b, &head).unwrap(),
        &chain.memories[2],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_data_is_never_reported_as_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    let store_dir = dir.path().join("store");
    let remote = RemoteStore::open_local(&store_dir)
        .unwrap()
        .with_options(quick_retry(3));
    let a = LocalCache::open(dir.path().join("a")).unwrap();
    let chain = build_chain(&a, dir.path(), 512, 100, 20);
    let head = chain.heads[2];
    remote
        .push(&a, &head, Some("top"), &NoProgress)
        .await
        .unwrap();

    let victim = a.read_layer(&head).unwrap().chunk_digest(0);
    let path = store_dir.join(object_key(&victim));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[7] ^= 0x55;
    std::fs::write(&path, &bytes).unwrap();
    let b = LocalCache::open(dir.path().join("b")).unwrap();
    let err = remote.pull_head(&b, &head, &NoProgress).await.unwrap_err();
    println!("corrupt chunk: {err}");
    assert!(!err.is_unavailable());
    assert!(
        matches!(&err, StoreError::CorruptObject { digest, .. } if *digest == victim),
        "{err:?}"
    );

    let layer_path = store_dir.join("layers").join(head.hex());
    let mut bytes = std::fs::read(&layer_path).unwrap();
    bytes[3] ^= 0x55;
    std::fs::write(&layer_path, &bytes).unwrap();
    let err = remote.pull_head(&b, &head, &NoProgress).await.unwrap_err();
    println!("corrupt manifest: {err}");
    assert!(!err.is_unavailable());
    assert!(matches!(err, StoreError::CorruptLayer { .. }), "{err:?}");
}
