//! The Firecracker-style vsock connector, against a stand-in for the VMM's
//! vsock Unix socket that forwards `CONNECT 52` to the agent.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};

use common::TestAgent;
use tine_agent::client::{AgentClient, ClientError, Connector};

/// Accepts connections on `uds`; `CONNECT 52` is forwarded to the agent,
/// any other port is refused by closing (as the VMM does without a listener).
fn fake_vmm(uds: &Path, agent_socket: PathBuf) {
    let listener = UnixListener::bind(uds).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let mut host = conn.unwrap();
            let agent_socket = agent_socket.clone();
            std::thread::spawn(move || {
                let mut line = Vec::new();
                let mut b = [0u8];
                while host.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
                    line.push(b[0]);
                }
                if line != b"CONNECT 52" {
                    return;
                }
                let guest = UnixStream::connect(agent_socket).unwrap();
                host.write_all(b"OK 1073741824\n").unwrap();
                let (mut h2, mut g2) = (host.try_clone().unwrap(), guest.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut h2, &mut g2);
                    let _ = g2.shutdown(std::net::Shutdown::Write);
                });
                let (mut host, mut guest) = (host, guest);
                let _ = std::io::copy(&mut guest, &mut host);
            });
        }
    });
}

#[test]
fn calls_go_through_the_connect_handshake() {
    let agent = TestAgent::start();
    let uds = agent.dir.path().join("vsock.sock");
    fake_vmm(&uds, agent.socket.clone());

    let c = AgentClient::new(Connector::vsock(&uds));
    assert!(!c.ping().unwrap().agent_version.is_empty());
    let (st, out, _) = c
        .exec_output(&["echo", "via vsock"], &Default::default())
        .unwrap();
    assert!(st.success());
    assert_eq!(out, b"via vsock\n");

    let wrong_port = AgentClient::new(Connector::Vsock { uds, port: 1234 });
    let err = wrong_port.ping().unwrap_err();
    assert!(
        matches!(&err, ClientError::Handshake { port: 1234, msg, .. } if msg.contains("closed")),
        "{err}"
    );
}

/// A call's request is sent behind the CONNECT line, before the VMM's `OK`: a VMM that
/// waits for it before answering the line still gets the call through.
#[test]
fn the_request_travels_with_the_connect_line() {
    let agent = TestAgent::start();
    let uds = agent.dir.path().join("vsock.sock");
    let listener = UnixListener::bind(&uds).unwrap();
    let agent_socket = agent.socket.clone();
    let vmm = std::thread::spawn(move || {
        let (mut host, _) = listener.accept().unwrap();
        let mut line = Vec::new();
        let mut b = [0u8];
        while host.read(&mut b).unwrap() == 1 && b[0] != b'\n' {
            line.push(b[0]);
        }
        assert_eq!(line, b"CONNECT 52");
        // The request's length prefix, before any OK has been written.
        host.set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut len = [0u8; 4];
        host.read_exact(&mut len)
            .expect("the request came with the CONNECT line");
        let mut guest = UnixStream::connect(agent_socket).unwrap();
        guest.write_all(&len).unwrap();
        host.write_all(b"OK 1073741824\n").unwrap();
        let (mut h2, mut g2) = (host.try_clone().unwrap(), guest.try_clone().unwrap());
        let up = std::thread::spawn(move || {
            let _ = std::io::copy(&mut h2, &mut g2);
            let _ = g2.shutdown(std::net::Shutdown::Write);
        });
        let _ = std::io::copy(&mut guest, &mut host);
        drop(host);
        up.join().unwrap();
    });
    let c = AgentClient::new(Connector::vsock(&uds));
    assert!(!c.ping().unwrap().agent_version.is_empty());
    vmm.join().unwrap();
}
