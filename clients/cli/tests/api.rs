//! `tine up` end to end with real clients: grpcurl (reflection, health, errors), the `tine`
//! CLI, the metrics endpoint, the audit log, and the generated Python client's test suite.
//! Needs grpcurl and python3 (deploy/dev/setup.sh installs them), so it is opt-in:
//! `cargo test -p tine-cli --test api -- --ignored`.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};

const TINE: &str = env!("CARGO_BIN_EXE_tine");

struct Up {
    child: Child,
    addr: String,
    token_file: String,
}

impl Drop for Up {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn up(data: &Path) -> Up {
    let mut child = Command::new(TINE)
        .args([
            "up",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--pool",
            "1",
        ])
        .arg("--data-dir")
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start tine up");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut get = |key: &str| {
        let l = lines.next().expect("tine up printed its address").unwrap();
        l.strip_prefix(&format!("{key}="))
            .unwrap_or_else(|| panic!("{l}"))
            .to_string()
    };
    let addr = get("TINE_ADDR");
    let token_file = get("TINE_TOKEN_FILE");
    Up {
        child,
        addr,
        token_file,
    }
}

fn grpcurl(args: &[&str]) -> (bool, String) {
    let out = Command::new("grpcurl")
        .args(args)
        .output()
        .expect("grpcurl not found: run deploy/dev/setup.sh and put its venv on PATH");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn tine(up: &Up, args: &[&str]) -> (i32, String) {
    let out = Command::new(TINE)
        .args(args)
        .env("TINE_ADDR", &up.addr)
        .env("TINE_TOKEN_FILE", &up.token_file)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn metrics(addr: &str) -> String {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

#[test]
#[ignore = "needs grpcurl and python3 (deploy/dev/setup.sh)"]
fn embedded_default_serves_real_grpc_clients() {
    let dir = tempfile::tempdir().unwrap();
    let up = up(dir.path());
    let host = up.addr.trim_start_matches("http://").to_string();
    let token = std::fs::read_to_string(&up.token_file).unwrap();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&up.token_file)
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "admin token file mode");
    let auth = format!("authorization: Bearer {token}");

    // Reflection (grpcurl 1.8.6 speaks v1alpha) and health.
    let (ok, out) = grpcurl(&["-plaintext", &host, "list"]);
    assert!(ok, "{out}");
    for svc in [
        "tine.v1.Snapshots",
        "tine.v1.Sandboxes",
        "tine.v1.Executors",
        "grpc.health.v1.Health",
    ] {
        assert!(out.contains(svc), "{svc} missing from:\n{out}");
    }
    let (ok, out) = grpcurl(&["-plaintext", &host, "describe", "tine.v1.Sandboxes.Spawn"]);
    assert!(ok && out.contains("stream .tine.v1.SpawnEvent"), "{out}");
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-d",
        "{}",
        &host,
        "grpc.health.v1.Health/Check",
    ]);
    assert!(ok && out.contains("SERVING"), "{out}");

    // Errors a user sees from a plain gRPC client.
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-d",
        "{}",
        &host,
        "tine.v1.Snapshots/ListSnapshots",
    ]);
    assert!(!ok && out.contains("Unauthenticated"), "{out}");
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-H",
        &auth,
        "-d",
        r#"{"tag":"py","count":0}"#,
        &host,
        "tine.v1.Sandboxes/Spawn",
    ]);
    assert!(
        !ok && out.contains("InvalidArgument") && out.contains("count"),
        "{out}"
    );
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-H",
        &auth,
        "-d",
        r#"{"tag":"../etc","count":1}"#,
        &host,
        "tine.v1.Sandboxes/Spawn",
    ]);
    assert!(!ok && out.contains("InvalidArgument"), "{out}");
    let (ok, out) = grpcurl(&[
        "-plaintext",
        "-H",
        &auth,
        "-d",
        r#"{"tag":"absent","count":2}"#,
        &host,
        "tine.v1.Sandboxes/Spawn",
    ]);
    assert!(!ok && out.contains("NotFound"), "{out}");

    // The local executor registered (its first registration is immediate).
    let mut listed = String::new();
    for _ in 0..50 {
        let (code, out) = tine(&up, &["executors", "ls"]);
        assert_eq!(code, 0, "{out}");
        listed = out;
        if listed.contains("local") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(
        listed
            .lines()
            .any(|l| l.starts_with("local") && l.contains(" up ")),
        "{listed}"
    );
    let (code, out) = tine(&up, &["sandbox", "spawn", "--tag", "absent", "-n", "1"]);
    assert!(code != 0 && out.contains("NOT_FOUND"), "{out}");

    // The Python client's suite against this server (its live tests; spawning needs a KVM host).
    let py = Command::new("bash")
        .arg(format!(
            "{}/../python/run_tests.sh",
            env!("CARGO_MANIFEST_DIR")
        ))
        .env("TINE_ADDR", &up.addr)
        .env("TINE_TOKEN_FILE", &up.token_file)
        .output()
        .unwrap();
    let py_out = format!(
        "{}{}",
        String::from_utf8_lossy(&py.stdout),
        String::from_utf8_lossy(&py.stderr)
    );
    assert!(py.status.success(), "python client tests:\n{py_out}");
    assert!(py_out.contains("0 failed"), "{py_out}");

    // Metrics and audit saw all of it.
    let text = std::fs::read_to_string(dir.path().join("audit.log")).unwrap();
    assert!(
        text.lines().any(|l| l.contains("\"UNAUTHENTICATED\"")),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("\"INVALID_ARGUMENT\"") && l.contains("\"admin\"")),
        "{text}"
    );
    let metrics_addr = std::fs::read_to_string(dir.path().join("up.json")).ok();
    if let Some(m) = metrics_addr {
        let v: serde_json::Value = serde_json::from_str(&m).unwrap();
        let body = metrics(v["metrics"].as_str().unwrap());
        assert!(
            body.contains(
                "tine_rpcs_total{code=\"INVALID_ARGUMENT\",rpc=\"tine.v1.Sandboxes/Spawn\"}"
            ),
            "{body}"
        );
        assert!(body.contains("tine_executors_up"), "{body}");
    } else {
        panic!("tine up did not write up.json");
    }

    // Log rotation: move the file away, SIGHUP, and the next call lands in a new file.
    let audit = dir.path().join("audit.log");
    std::fs::rename(&audit, dir.path().join("audit.log.1")).unwrap();
    // SAFETY: plain kill(2) of our own child process.
    assert_eq!(unsafe { libc::kill(up.child.id() as i32, libc::SIGHUP) }, 0);
    let mut reopened = false;
    for _ in 0..50 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        let (code, out) = tine(&up, &["snapshots", "ls"]);
        assert_eq!(code, 0, "{out}");
        if std::fs::read_to_string(&audit).is_ok_and(|t| t.contains("ListSnapshots")) {
            reopened = true;
            break;
        }
    }
    assert!(reopened, "no new audit.log after SIGHUP");
}
