//! The host-side client against a peer that breaks the protocol on purpose, standing in for
//! a compromised guest agent (the lab's hostile-agent scenario does the same through a real
//! guest): every misbehaviour ends the call with a clear error, in bounded time and memory.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tine_agent::client::{AgentClient, Cancel, ClientError, Connector, ExecOptions};
use tine_agent::frame::{FrameError, MAX_FRAME};

const STALL: Duration = Duration::from_millis(300);

/// A peer that reads the request's length prefix and body, then does `act` with the stream.
fn peer(act: fn(UnixStream)) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&path).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let mut s = conn.unwrap();
            std::thread::spawn(move || {
                let mut len = [0u8; 4];
                if s.read_exact(&mut len).is_err() {
                    return;
                }
                let mut req = vec![0u8; u32::from_be_bytes(len) as usize];
                if s.read_exact(&mut req).is_ok() {
                    act(s);
                }
            });
        }
    });
    (dir, path)
}

fn client(path: &Path) -> AgentClient {
    AgentClient::new(Connector::Unix(path.to_path_buf())).with_stall_timeout(STALL)
}

fn exec(c: &AgentClient) -> Result<(), ClientError> {
    c.exec(&["true"], &ExecOptions::default(), |_| {}, |_| {})
        .map(|_| ())
}

fn hold(s: UnixStream) {
    std::thread::sleep(Duration::from_secs(60));
    drop(s);
}

#[test]
fn a_malformed_frame_is_refused() {
    // Wire type 7 does not exist: this can never decode as a response.
    let (_d, p) = peer(|mut s| {
        s.write_all(&[0, 0, 0, 8]).unwrap();
        s.write_all(&[0xff; 8]).unwrap();
        hold(s)
    });
    let err = exec(&client(&p)).unwrap_err();
    assert!(
        matches!(err, ClientError::Transport(FrameError::Decode(_))),
        "{err}"
    );
}

#[test]
fn an_oversized_frame_is_refused_before_anything_is_allocated() {
    let (_d, p) = peer(|mut s| {
        s.write_all(&u32::MAX.to_be_bytes()).unwrap();
        hold(s)
    });
    let err = exec(&client(&p)).unwrap_err();
    assert!(
        matches!(err, ClientError::Transport(FrameError::TooLarge { len, max })
            if len == u32::MAX as usize && max == MAX_FRAME),
        "{err}"
    );
}

#[test]
fn a_frame_that_stops_halfway_times_out() {
    let (_d, p) = peer(|mut s| {
        s.write_all(&(MAX_FRAME as u32).to_be_bytes()).unwrap();
        s.write_all(&[0; 1024]).unwrap();
        hold(s)
    });
    let t = Instant::now();
    let err = exec(&client(&p)).unwrap_err();
    assert!(
        matches!(err, ClientError::StalledFrame(d, len) if d == STALL && len == MAX_FRAME),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}

#[test]
fn a_frame_that_trickles_in_times_out_too() {
    // A byte every 50 ms keeps every single read short, but not the frame.
    let (_d, p) = peer(|mut s| {
        s.write_all(&(MAX_FRAME as u32).to_be_bytes()).unwrap();
        while s.write_all(&[0]).is_ok() {
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let err = exec(&client(&p)).unwrap_err();
    assert!(
        matches!(err, ClientError::StalledFrame(d, _) if d == STALL),
        "{err}"
    );
}

#[test]
fn a_peer_that_reads_a_trickle_fails_the_upload() {
    let (_d, p) = peer(|mut s| {
        let mut b = [0u8; 1];
        while s.read_exact(&mut b).is_ok() {
            std::thread::sleep(Duration::from_millis(50));
        }
    });
    let data = std::io::repeat(b'x').take(256 << 20);
    let err = client(&p).write_file("/f", 0o644, data).unwrap_err();
    assert!(
        matches!(err, ClientError::StoppedReading(d) if d == STALL),
        "{err}"
    );
}

#[test]
fn a_peer_that_never_reads_fails_the_upload() {
    let (_d, p) = peer(hold);
    let data = std::io::repeat(b'x').take(256 << 20);
    let t = Instant::now();
    let err = client(&p).write_file("/f", 0o644, data).unwrap_err();
    assert!(
        matches!(err, ClientError::StoppedReading(d) if d == STALL),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30), "{:?}", t.elapsed());
}

#[test]
fn a_silent_peer_is_cut_off_by_cancel_and_by_an_exec_timeout() {
    let (_d, p) = peer(hold);
    let cancel = Cancel::default();
    let c = client(&p).with_cancel(cancel.clone());
    let waiter = std::thread::spawn(move || {
        let t = Instant::now();
        (exec(&c), t.elapsed(), c)
    });
    std::thread::sleep(Duration::from_millis(200));
    cancel.cancel();
    let (res, took, c) = waiter.join().unwrap();
    assert!(matches!(res, Err(ClientError::Cancelled)), "{res:?}");
    assert!(took < Duration::from_secs(30), "{took:?}");
    // Later calls on a cancelled client fail at once.
    assert!(matches!(exec(&c), Err(ClientError::Cancelled)));

    // An exec with a timeout waits for its exit that long plus the stall timeout.
    let opts = ExecOptions {
        timeout: Some(Duration::from_millis(200)),
        ..Default::default()
    };
    let err = client(&p)
        .exec(&["sleep", "1"], &opts, |_| {}, |_| {})
        .unwrap_err();
    assert!(
        matches!(err, ClientError::NoAnswer(d) if d <= Duration::from_millis(500)),
        "{err}"
    );
}
