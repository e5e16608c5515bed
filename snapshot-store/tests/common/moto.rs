//! Starts a real `moto_server` (PyPI `moto[server]`) on a free loopback port.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tine_snapshot_store::remote::{RemoteStore, S3Config};

pub struct Moto {
    child: Child,
    pub endpoint: String,
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `moto_server` from $MOTO_SERVER, PATH or a repo venv; else `python3 -m moto.server`
/// when the module is importable (pip may not have put a script on PATH).
fn find_moto() -> Option<(PathBuf, Vec<String>)> {
    if let Some(p) = std::env::var_os("MOTO_SERVER") {
        return Some((PathBuf::from(p), vec![]));
    }
    let mut candidates: Vec<PathBuf> =
        std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
            .map(|d| d.join("moto_server"))
            .collect();
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    candidates.push(root.join(".venv/bin/moto_server"));
    candidates.push(root.join(".ci/venv/bin/moto_server"));
    if let Some(p) = candidates.into_iter().find(|p| p.is_file()) {
        return Some((p, vec![]));
    }
    let importable = Command::new("python3")
        .args(["-c", "import moto.server"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    importable.then(|| {
        (
            PathBuf::from("python3"),
            vec!["-m".into(), "moto.server".into()],
        )
    })
}

/// None when TINE_SKIP_S3=1; panics with the install hint when moto is missing.
pub fn start() -> Option<Moto> {
    if std::env::var("TINE_SKIP_S3").is_ok_and(|v| v == "1") {
        eprintln!("TINE_SKIP_S3=1: skipping the S3 test");
        return None;
    }
    let (bin, prefix_args) = find_moto().unwrap_or_else(|| {
        panic!(
            "moto_server not found on PATH (nor $MOTO_SERVER, .venv/bin): install it with \
             `pip install 'moto[server]'` or set TINE_SKIP_S3=1 to skip the S3 tests"
        )
    });
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = Command::new(&bin)
        .args(&prefix_args)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let mut moto = Moto {
        child,
        endpoint: format!("http://127.0.0.1:{port}"),
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = moto.child.try_wait() {
            panic!(
                "{} exited ({status}) before listening: install moto with \
                 `pip install 'moto[server]'` or set TINE_SKIP_S3=1 to skip the S3 tests",
                bin.display()
            );
        }
        assert!(
            Instant::now() < deadline,
            "moto_server did not listen on port {port} within 30 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    Some(moto)
}

impl Moto {
    /// Creates a bucket with a bare HTTP request (moto does not check signatures).
    pub fn create_bucket(&self, bucket: &str) {
        let port = self.endpoint.rsplit(':').next().unwrap();
        let mut s = TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
        write!(s, "PUT /{bucket} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(
            resp.starts_with("HTTP/1.1 200"),
            "bucket creation failed: {resp}"
        );
    }

    pub fn store(&self, bucket: &str, prefix: &str) -> RemoteStore {
        RemoteStore::open_s3(&S3Config {
            bucket: bucket.into(),
            prefix: prefix.into(),
            endpoint: Some(self.endpoint.clone()),
            region: Some("us-east-1".into()),
            access_key_id: Some("testing".into()),
            secret_access_key: Some("testing".into()),
            allow_http: true,
            ..Default::default()
        })
        .unwrap()
    }
}
