//! How the services treat connections: a peer that goes silent (stops answering HTTP/2 pings,
//! or vanishes without a FIN) is dropped rather than held forever.

use std::time::Duration;

use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Keepalive {
    /// How often a connection is pinged (HTTP/2 PING; TCP keepalive probes start after it too).
    pub interval: Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub timeout: Duration,
}

impl Default for Keepalive {
    fn default() -> Self {
        Keepalive {
            interval: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
        }
    }
}

impl Keepalive {
    /// `builder` pinging its connections.
    pub fn server<L>(&self, builder: Server<L>) -> Server<L> {
        builder
            .http2_keepalive_interval(Some(self.interval))
            .http2_keepalive_timeout(Some(self.timeout))
    }

    /// The accepted connections of `listener`: no Nagle delay, TCP keepalive on.
    pub fn incoming(&self, listener: tokio::net::TcpListener) -> TcpIncoming {
        TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(self.interval))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A client that opens an HTTP/2 connection and then never answers the server's pings is
    /// disconnected after about interval + timeout.
    #[tokio::test]
    async fn a_peer_that_stops_answering_pings_is_dropped() {
        let k = Keepalive {
            interval: Duration::from_millis(300),
            timeout: Duration::from_millis(300),
        };
        let (_reporter, health) = tonic_health::server::health_reporter();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = k.server(Server::builder()).add_service(health);
        tokio::spawn(router.serve_with_incoming(k.incoming(listener)));

        let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
        // The client preface and an empty SETTINGS frame; nothing after, pings included.
        conn.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
            .await
            .unwrap();
        let t0 = std::time::Instant::now();
        let mut buf = [0u8; 4096];
        let mut pings = 0;
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    // A PING frame's type byte (frames may share a read: count roughly).
                    Ok(n) => pings += buf[..n].windows(2).filter(|w| w == &[8, 6]).count(),
                }
            }
        })
        .await;
        assert!(closed.is_ok(), "still open after 10 s");
        println!("closed after {:?} ({pings} pings)", t0.elapsed());
        assert!(t0.elapsed() >= k.interval, "closed before any ping was due");
    }
}
