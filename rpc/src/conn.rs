//! How the services treat connections: a peer that goes silent (stops answering HTTP/2 pings,
//! or vanishes without a FIN) is dropped rather than held forever, and so is one that connects
//! and never sends its HTTP/2 preface. Streams and header sizes per connection are bounded.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_stream::{Stream, StreamExt};
use tonic::transport::server::{Connected, TcpIncoming};
use tonic::transport::Server;

/// Bytes of the HTTP/2 client preface (`PRI * HTTP/2.0...`).
const PREFACE_BYTES: usize = 24;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connections {
    /// How often a connection is pinged (HTTP/2 PING; TCP keepalive probes start after it too).
    pub interval: Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub timeout: Duration,
    /// How long a new connection has to send its HTTP/2 preface (over TLS: to finish the
    /// handshake).
    pub preface: Duration,
    /// Concurrent calls per connection (more wait at the client for a free stream).
    pub max_streams: u32,
    /// Bytes of request headers per call.
    pub max_header_bytes: u32,
}

impl Default for Connections {
    fn default() -> Self {
        Connections {
            interval: Duration::from_secs(30),
            timeout: Duration::from_secs(10),
            preface: Duration::from_secs(10),
            max_streams: 1024,
            max_header_bytes: 16 << 10,
        }
    }
}

impl Connections {
    /// `builder` pinging its connections and bounding their streams.
    pub fn server<L>(&self, builder: Server<L>) -> Server<L> {
        builder
            .http2_keepalive_interval(Some(self.interval))
            .http2_keepalive_timeout(Some(self.timeout))
            .max_concurrent_streams(Some(self.max_streams))
            .http2_max_header_list_size(Some(self.max_header_bytes))
    }

    /// The accepted connections of `listener`: no Nagle delay, TCP keepalive on, closed if
    /// they send no preface in time.
    pub fn incoming(
        &self,
        listener: tokio::net::TcpListener,
    ) -> impl Stream<Item = io::Result<Preface<tokio::net::TcpStream>>> + Send + 'static {
        let deadline = self.preface;
        TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(self.interval))
            .map(move |conn| conn.map(|c| Preface::new(c, deadline)))
    }
}

/// A connection that must deliver the HTTP/2 preface's bytes before a deadline; reads fail
/// with TimedOut after it.
pub struct Preface<IO> {
    inner: IO,
    /// Preface bytes still to come (0: the deadline no longer applies).
    missing: usize,
    deadline: Pin<Box<tokio::time::Sleep>>,
    within: Duration,
}

impl<IO> Preface<IO> {
    pub fn new(inner: IO, within: Duration) -> Preface<IO> {
        Preface {
            inner,
            missing: PREFACE_BYTES,
            deadline: Box::pin(tokio::time::sleep(within)),
            within,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Preface<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.missing == 0 {
            return Pin::new(&mut self.inner).poll_read(cx, buf);
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                let n = buf.filled().len() - before;
                self.missing = self.missing.saturating_sub(n);
                Poll::Ready(Ok(()))
            }
            Poll::Pending if self.deadline.as_mut().poll(cx).is_ready() => {
                Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no HTTP/2 preface within {:?}", self.within),
                )))
            }
            other => other,
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Preface<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<IO: Connected> Connected for Preface<IO> {
    type ConnectInfo = IO::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A health service behind `k`'s connection policy; its address.
    async fn serve_health(k: Connections) -> std::net::SocketAddr {
        let (_reporter, health) = tonic_health::server::health_reporter();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = k.server(Server::builder()).add_service(health);
        tokio::spawn(router.serve_with_incoming(k.incoming(listener)));
        addr
    }

    /// A client that opens an HTTP/2 connection and then never answers the server's pings is
    /// disconnected after about interval + timeout.
    #[tokio::test]
    async fn a_peer_that_stops_answering_pings_is_dropped() {
        let k = Connections {
            interval: Duration::from_millis(300),
            timeout: Duration::from_millis(300),
            ..Connections::default()
        };
        let addr = serve_health(k).await;

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

    /// A connection that sends nothing, or less than the preface, is closed at the deadline;
    /// one that sends the preface outlives it.
    #[tokio::test]
    async fn a_peer_that_never_sends_its_preface_is_dropped() {
        let k = Connections {
            preface: Duration::from_millis(400),
            ..Connections::default()
        };
        let addr = serve_health(k).await;

        async fn open_after(addr: std::net::SocketAddr, send: &[u8], wait: Duration) -> bool {
            let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
            conn.write_all(send).await.unwrap();
            let mut buf = [0u8; 4096];
            let deadline = tokio::time::Instant::now() + wait;
            loop {
                match tokio::time::timeout_at(deadline, conn.read(&mut buf)).await {
                    Err(_) => return true,
                    Ok(Ok(0)) | Ok(Err(_)) => return false,
                    Ok(Ok(_)) => {}
                }
            }
        }
        let t0 = std::time::Instant::now();
        assert!(!open_after(addr, b"", Duration::from_secs(5)).await);
        let silent = t0.elapsed();
        assert!(
            silent >= Duration::from_millis(400),
            "closed after {silent:?}"
        );
        assert!(!open_after(addr, b"PRI * HTTP/2.0", Duration::from_secs(5)).await);
        let preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00";
        assert!(open_after(addr, preface, Duration::from_millis(1500)).await);
        println!("a silent connection was closed after {silent:?}");
    }
}
