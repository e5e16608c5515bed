//! Exposed ports: a TCP listener on the executor host that forwards each connection to one
//! port of one child's guest, through the child's link address (its namespace forwards that
//! address to the guest). Dropped, it stops accepting; it is dropped with its child.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Shutdown, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a connection waits for the guest to accept.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections relayed at once per exposed port; more are refused (closed at once).
const MAX_CONNECTIONS: usize = 256;

/// The sockets of the connections being relayed, so dropping the forward ends them too.
#[derive(Default)]
struct Live {
    next: u64,
    conns: HashMap<u64, (TcpStream, TcpStream)>,
}

type Conns = Arc<Mutex<Live>>;

pub struct Forward {
    addr: SocketAddr,
    guest_port: u16,
    listener: Arc<TcpListener>,
    stop: Arc<AtomicBool>,
    conns: Conns,
}

impl Forward {
    /// Listen on `bind` (a free port) and forward to `target`.
    pub fn open(bind: IpAddr, target: SocketAddrV4) -> io::Result<Forward> {
        let listener = Arc::new(TcpListener::bind((bind, 0))?);
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Conns::default();
        let (l, s, c) = (listener.clone(), stop.clone(), conns.clone());
        std::thread::Builder::new()
            .name(format!("expose-{}", addr.port()))
            .spawn(move || accept_loop(&l, &s, &c, target))?;
        Ok(Forward {
            addr,
            guest_port: target.port(),
            listener,
            stop,
            conns,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn guest_port(&self) -> u16 {
        self.guest_port
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wakes the blocked accept (it fails with EINVAL) so the thread sees `stop`.
        // SAFETY: shutdown on a socket this struct shares ownership of.
        unsafe { libc::shutdown(self.listener.as_raw_fd(), libc::SHUT_RDWR) };
        // And the connections in flight: their relays see the sockets closed and end.
        let live = self.conns.lock().unwrap_or_else(|p| p.into_inner());
        for (client, guest) in live.conns.values() {
            let _ = client.shutdown(Shutdown::Both);
            let _ = guest.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(listener: &TcpListener, stop: &AtomicBool, conns: &Conns, target: SocketAddrV4) {
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::Acquire) {
            return;
        }
        match accepted {
            Ok((client, _)) => {
                if conns.lock().unwrap_or_else(|p| p.into_inner()).conns.len() >= MAX_CONNECTIONS {
                    continue; // dropped: closed at once
                }
                let c = conns.clone();
                let _ = std::thread::Builder::new()
                    .name("expose-conn".into())
                    .spawn(move || relay(client, target, &c));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!("exposed port for {target}: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Copy both ways until each side has closed its half (or the forward is dropped).
fn relay(client: TcpStream, target: SocketAddrV4, conns: &Conns) {
    let guest = match TcpStream::connect_timeout(&target.into(), CONNECT_TIMEOUT) {
        Ok(g) => g,
        Err(e) => {
            tracing::debug!("exposed port: connecting to {target}: {e}");
            return;
        }
    };
    let (Ok(client2), Ok(guest2), Ok(client3), Ok(guest3)) = (
        client.try_clone(),
        guest.try_clone(),
        client.try_clone(),
        guest.try_clone(),
    ) else {
        return;
    };
    let key = {
        let mut live = conns.lock().unwrap_or_else(|p| p.into_inner());
        live.next += 1;
        let key = live.next;
        live.conns.insert(key, (client3, guest3));
        key
    };
    let up = std::thread::spawn(move || pipe(client2, guest2));
    pipe(guest, client);
    let _ = up.join();
    conns
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .conns
        .remove(&key);
}

fn pipe(mut from: TcpStream, mut to: TcpStream) {
    let _ = io::copy(&mut from, &mut to);
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::Ipv4Addr;

    #[test]
    fn forwards_both_ways_and_stops_when_dropped() {
        let backend = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = match backend.local_addr().unwrap() {
            SocketAddr::V4(a) => a,
            _ => unreachable!(),
        };
        std::thread::spawn(move || {
            let (mut c, _) = backend.accept().unwrap();
            let mut buf = [0u8; 5];
            c.read_exact(&mut buf).unwrap();
            c.write_all(&buf.map(|b| b.to_ascii_uppercase())).unwrap();
        });
        let f = Forward::open(IpAddr::V4(Ipv4Addr::LOCALHOST), target).unwrap();
        let mut c = TcpStream::connect(f.addr()).unwrap();
        c.write_all(b"hello").unwrap();
        let mut got = String::new();
        c.read_to_string(&mut got).unwrap();
        assert_eq!(got, "HELLO");
        let addr = f.addr();
        drop(f);
        std::thread::sleep(Duration::from_millis(100));
        assert!(TcpStream::connect(addr).is_err(), "closed once dropped");
    }

    #[test]
    fn dropping_the_forward_ends_connections_in_flight() {
        let backend = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = match backend.local_addr().unwrap() {
            SocketAddr::V4(a) => a,
            _ => unreachable!(),
        };
        // The guest's server accepts and then says nothing.
        let held = std::thread::spawn(move || backend.accept().unwrap().0);
        let f = Forward::open(IpAddr::V4(Ipv4Addr::LOCALHOST), target).unwrap();
        let mut c = TcpStream::connect(f.addr()).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let _guest_side = held.join().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        drop(f);
        let mut buf = [0u8; 1];
        let n = c.read(&mut buf).expect("closed, not timed out");
        assert_eq!(n, 0, "the client sees the connection end");
    }
}
