//! The host-side client against an agent that answers, but only after longer than the first
//! wait: polling must reach it without piling abandoned calls on it.

use std::io::Read;
use std::os::unix::net::UnixListener;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tine_agent::client::{AgentClient, Connector};
use tine_agent::frame::{read_frame_body, read_frame_len, write_message};
use tine_agent::pb;

#[test]
fn a_guest_slower_than_the_first_wait_is_reached_on_the_next_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let calls = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&calls);
    // Each call is answered 2.5 s after it came: later than the first 2 s wait.
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let mut s = conn.unwrap();
            counted.fetch_add(1, Ordering::SeqCst);
            std::thread::spawn(move || {
                let Ok(len) = read_frame_len(&mut s) else {
                    return;
                };
                if read_frame_body(&mut s, len).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(2500));
                let ping = pb::PingResponse {
                    agent_version: "slow".into(),
                    uptime_ms: 1,
                    readiness: pb::Readiness::Ready as i32,
                    ..Default::default()
                };
                let _ = write_message(
                    &mut s,
                    &pb::Response {
                        kind: Some(pb::response::Kind::Ping(ping)),
                    },
                );
                let _ = s.read(&mut [0u8; 1]);
            });
        }
    });
    let client = AgentClient::new(Connector::Unix(path));
    let p = client
        .wait_ready(Duration::from_secs(20))
        .expect("answered within its second wait");
    assert_eq!(p.agent_version, "slow");
    // The first call was abandoned after 2 s; the second waited 4 s and was answered.
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}
