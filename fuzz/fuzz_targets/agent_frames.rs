//! What a hostile guest agent can answer the host: the fuzz input is every byte the "agent"
//! sends back on a connection (frames, or anything else), and the host's client makes one of
//! its real calls against it. The client must fail cleanly (never panic, never allocate what a
//! length prefix claims before the bytes arrive, never hang past its timeouts).
#![no_main]

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use tine_agent::client::{AgentClient, CloneIdentity, Connector, ExecOptions};

struct Agent {
    sock: PathBuf,
    answer: Arc<Mutex<Vec<u8>>>,
    _dir: tempfile::TempDir,
}

/// One "agent" per process: a Unix socket that, on each connection, reads the client's first
/// frame, sends the current answer, closes its sending side and drains what else comes.
fn agent() -> &'static Agent {
    static AGENT: OnceLock<Agent> = OnceLock::new();
    AGENT.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("agent.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        let answer = Arc::new(Mutex::new(Vec::new()));
        let served = answer.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                serve(conn, &served.lock().unwrap());
            }
        });
        Agent {
            sock,
            answer,
            _dir: dir,
        }
    })
}

fn serve(mut conn: UnixStream, answer: &[u8]) {
    let _ = conn.set_read_timeout(Some(Duration::from_millis(200)));
    let _ = tine_agent::frame::read_frame_bytes(&mut conn);
    let _ = conn.write_all(answer);
    let _ = conn.shutdown(std::net::Shutdown::Write);
    let mut sink = [0u8; 64 << 10];
    while matches!(conn.read(&mut sink), Ok(n) if n > 0) {}
}

fuzz_target!(|data: &[u8]| {
    let Some((&which, answer)) = data.split_first() else {
        return;
    };
    let agent = agent();
    *agent.answer.lock().unwrap() = answer.to_vec();
    let client = AgentClient::new(Connector::Unix(agent.sock.clone()))
        .with_io_timeout(Some(Duration::from_secs(2)))
        .with_stall_timeout(Duration::from_secs(2));
    match which % 10 {
        0 => drop(client.ping()),
        1 => drop(client.exec(
            &["sh", "-c", "true"],
            &ExecOptions {
                stdin: b"in".to_vec(),
                ..ExecOptions::default()
            },
            |_| {},
            |_| {},
        )),
        2 => drop(client.eval("1 + 1")),
        3 => drop(client.read_file("/etc/hostname", &mut Vec::new())),
        4 => drop(client.list_dir("/")),
        5 => drop(client.write_file("/tmp/f", 0o644, &b"data"[..])),
        6 => drop(client.reseed(&[7u8; 32], Some(&CloneIdentity::new("sbx-1", [1; 16])))),
        7 => drop(client.prepare_snapshot()),
        8 => drop(client.wake(
            std::time::SystemTime::now(),
            &[7u8; 32],
            Some(&CloneIdentity::new("sbx-1", [1; 16])),
            Duration::from_secs(2),
        )),
        _ => drop(client.set_time(std::time::SystemTime::UNIX_EPOCH)),
    }
});
