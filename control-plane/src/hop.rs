//! The transport of calls to one executor. For `http://` executors a call goes straight onto
//! the executor's HTTP/2 connection. tonic's `Channel` puts a buffer task in front of the
//! connection, so every call (and every spawn) waits for that task to be scheduled before the
//! request reaches the connection. Other addresses (`https://`) keep tonic's channel, which
//! brings the TLS set-up.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::uri::{Authority, Scheme};
use http::{Request, Response, Uri};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::transport::Channel;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a new connection may take, on either transport.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings while calls are open, so a connection the network dropped is found.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(30);

/// One executor's transport, cheap to clone (clones share the connection).
#[derive(Clone)]
pub enum Hop {
    Plain(Plain),
    Channel(Channel),
}

impl Service<Request<Body>> for Hop {
    type Response = Response<Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        match self {
            // Nothing to wait for: a call finds or makes its connection when it is sent.
            Hop::Plain(_) => Poll::Ready(Ok(())),
            Hop::Channel(c) => c.poll_ready(cx).map_err(Into::into),
        }
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        match self {
            Hop::Plain(p) => {
                let p = p.clone();
                Box::pin(async move { p.send(req).await })
            }
            Hop::Channel(c) => {
                let f = c.call(req);
                Box::pin(async move {
                    f.await.map_err(|e| -> BoxError {
                        // The same code for a passed deadline whichever the transport.
                        let timed_out = std::iter::successors(
                            Some(&e as &(dyn std::error::Error + 'static)),
                            |s| s.source(),
                        )
                        .any(|s| s.is::<tonic::TimeoutExpired>());
                        if timed_out {
                            Box::new(tonic::Status::deadline_exceeded(e.to_string()))
                        } else {
                            Box::new(e)
                        }
                    })
                })
            }
        }
    }
}

/// The source of the UNAVAILABLE status of a call that got no answer from its executor (no
/// connection, or it broke before the answer), so callers can tell it from an executor's own
/// UNAVAILABLE.
#[derive(Debug, thiserror::Error)]
#[error("the executor's connection failed")]
pub struct Unreachable;

/// A plain HTTP/2 connection to one executor, made on the first call and made again on the
/// next call after it closed.
#[derive(Clone)]
pub struct Plain {
    inner: Arc<PlainInner>,
}

struct PlainInner {
    authority: Authority,
    live: Mutex<Option<SendRequest<Body>>>,
    /// Held while connecting, so calls that find no connection make one between them.
    connecting: tokio::sync::Mutex<()>,
    /// When the last attempt to connect failed, and why: calls that waited for that attempt
    /// fail with it rather than each trying again in turn.
    failed: Mutex<Option<(Instant, String)>>,
}

impl Plain {
    /// For `uri`, an `http://` address with a host and port.
    pub fn new(uri: &Uri) -> Result<Plain, String> {
        if uri.scheme() != Some(&Scheme::HTTP) {
            return Err(format!("{uri}: not an http:// address"));
        }
        let authority = uri
            .authority()
            .filter(|a| a.port_u16().is_some())
            .ok_or_else(|| format!("{uri}: no host and port"))?
            .clone();
        Ok(Plain {
            inner: Arc::new(PlainInner {
                authority,
                live: Mutex::new(None),
                connecting: tokio::sync::Mutex::new(()),
                failed: Mutex::new(None),
            }),
        })
    }

    fn live(&self) -> Option<SendRequest<Body>> {
        let live = self.inner.live.lock().unwrap_or_else(|p| p.into_inner());
        live.as_ref().filter(|s| !s.is_closed()).cloned()
    }

    /// The live connection, or a new one. `asked`: when the call began to wait for it.
    async fn sender(&self, asked: Instant) -> Result<SendRequest<Body>, String> {
        if let Some(s) = self.live() {
            return Ok(s);
        }
        let _one = self.inner.connecting.lock().await;
        if let Some(s) = self.live() {
            return Ok(s);
        }
        let failed_meanwhile = {
            let failed = self.inner.failed.lock().unwrap_or_else(|p| p.into_inner());
            failed
                .as_ref()
                .filter(|(at, _)| *at >= asked)
                .map(|(at, why)| format!("{why} ({:?} ago)", at.elapsed()))
        };
        if let Some(why) = failed_meanwhile {
            return Err(why);
        }
        match self.connect().await {
            Ok(send) => {
                *self.inner.failed.lock().unwrap_or_else(|p| p.into_inner()) = None;
                *self.inner.live.lock().unwrap_or_else(|p| p.into_inner()) = Some(send.clone());
                Ok(send)
            }
            Err(e) => {
                let why = e.to_string();
                *self.inner.failed.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((Instant::now(), why.clone()));
                Err(why)
            }
        }
    }

    async fn connect(&self) -> Result<SendRequest<Body>, BoxError> {
        let addr = self.inner.authority.as_str();
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr))
            .await
            .map_err(|_| format!("timed out after {CONNECT_TIMEOUT:?}"))??;
        tcp.set_nodelay(true)?;
        let mut builder = hyper::client::conn::http2::Builder::new(TokioExecutor::new());
        builder
            .timer(TokioTimer::new())
            .keep_alive_interval(KEEP_ALIVE);
        let (send, conn) = builder.handshake(TokioIo::new(tcp)).await?;
        let peer = addr.to_string();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(executor = %peer, "executor connection ended: {e}");
            }
        });
        Ok(send)
    }

    /// Forget the live connection: it gave a request back unsent. (A new one another call
    /// made meanwhile would be forgotten too; its calls keep it, and the next makes another.)
    fn forget(&self) {
        *self.inner.live.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// The call's `grpc-timeout` holds from here to the answer's headers, connecting
    /// included, as in tonic's channel (a passed deadline is DEADLINE_EXCEEDED). Errors
    /// before an answer are UNAVAILABLE, name the executor and have [`Unreachable`] as their
    /// source.
    async fn send(&self, req: Request<Body>) -> Result<Response<Body>, BoxError> {
        let deadline = req
            .headers()
            .get("grpc-timeout")
            .and_then(|v| grpc_timeout(v.to_str().ok()?));
        let answer = self.answer(req);
        match deadline {
            Some(d) => tokio::time::timeout(d, answer).await.unwrap_or_else(|_| {
                Err(Box::new(tonic::Status::deadline_exceeded(format!(
                    "executor {}: no answer within the call's deadline of {d:?}",
                    self.inner.authority
                ))))
            }),
            None => answer.await,
        }
    }

    async fn answer(&self, req: Request<Body>) -> Result<Response<Body>, BoxError> {
        let unreachable = |what: &str, e: &dyn std::fmt::Display| -> BoxError {
            let mut st = tonic::Status::unavailable(format!(
                "executor {}: {what}: {e}",
                self.inner.authority
            ));
            st.set_source(Arc::new(Unreachable));
            Box::new(st)
        };
        let asked = Instant::now();
        // HTTP/2 needs the scheme and authority on every request; tonic's client gives a path.
        let (mut head, body) = req.into_parts();
        let mut parts = std::mem::take(&mut head.uri).into_parts();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.inner.authority.clone());
        head.uri = Uri::from_parts(parts)?;
        let mut req = Request::from_parts(head, body);
        // A connection the executor has closed (it restarted, say) can look live until it is
        // used: a request it gives back unsent goes once more, on a new connection.
        let mut again = true;
        loop {
            let mut send = self
                .sender(asked)
                .await
                .map_err(|e| unreachable("no connection", &e))?;
            match send.try_send_request(req).await {
                Ok(resp) => return Ok(resp.map(Body::new)),
                Err(mut e) => match e.take_message() {
                    Some(unsent) if again => {
                        self.forget();
                        req = unsent;
                        again = false;
                    }
                    _ => return Err(unreachable("no answer", &e.into_error())),
                },
            }
        }
    }
}

/// A `grpc-timeout` value: at most 8 digits and a unit.
pub(crate) fn grpc_timeout(v: &str) -> Option<Duration> {
    let (n, unit) = v.split_at(v.len().checked_sub(1)?);
    if n.is_empty() || n.len() > 8 {
        return None;
    }
    let n: u64 = n.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;

    #[test]
    fn grpc_timeouts_parse_and_bad_ones_are_none() {
        assert_eq!(grpc_timeout("5S"), Some(Duration::from_secs(5)));
        assert_eq!(grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(grpc_timeout("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(
            grpc_timeout("99999999n"),
            Some(Duration::from_nanos(99_999_999))
        );
        for bad in ["", "S", "5", "5X", "123456789S", "-1S", "1.5S"] {
            assert_eq!(grpc_timeout(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_plain_addresses_with_a_port_go_direct() {
        assert!(Plain::new(&"http://127.0.0.1:7001".parse().unwrap()).is_ok());
        assert!(Plain::new(&"https://127.0.0.1:7001".parse().unwrap()).is_err());
        assert!(Plain::new(&"http://executor".parse().unwrap()).is_err());
    }

    /// A gRPC server (the health service) on `listener` until `stop` fires; `accepted`
    /// counts its connections.
    fn serve(
        listener: tokio::net::TcpListener,
        stop: tokio::sync::oneshot::Receiver<()>,
        accepted: Arc<std::sync::atomic::AtomicUsize>,
    ) -> tokio::task::JoinHandle<()> {
        use tokio_stream::StreamExt;
        let (_reporter, health) = tonic_health::server::health_reporter();
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(move |c| {
            accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            c
        });
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stop.await;
                })
                .await
                .unwrap();
        })
    }

    async fn check(hop: &Hop) -> Result<i32, tonic::Status> {
        let mut c = HealthClient::new(hop.clone());
        let r = c.check(HealthCheckRequest::default()).await?;
        Ok(r.into_inner().status)
    }

    #[tokio::test]
    async fn calls_share_one_connection_and_a_new_one_is_made_after_a_restart() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = || accepted.load(std::sync::atomic::Ordering::SeqCst);
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let server = serve(listener, stopped, accepted.clone());
        let hop = Hop::Plain(Plain::new(&format!("http://{addr}").parse().unwrap()).unwrap());
        // The first calls all at once, with no connection yet: they make one between them.
        let first = futures::future::join_all((0..8).map(|_| check(&hop))).await;
        assert!(
            first.iter().all(|r| r.as_ref().ok() == Some(&1)),
            "{first:?}"
        );
        assert_eq!(check(&hop).await.unwrap(), 1, "SERVING");
        assert_eq!(count(), 1, "one connection");

        // The executor restarts on the same address: the next call gets through, on a new
        // connection, though the old one may still look open when it is made.
        stop.send(()).unwrap();
        server.await.unwrap();
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let server = serve(listener, stopped, accepted.clone());
        assert_eq!(check(&hop).await.unwrap(), 1);
        assert_eq!(count(), 2);

        // It is gone: the call is UNAVAILABLE, names it, and says the connection failed.
        stop.send(()).unwrap();
        server.await.unwrap();
        let e = check(&hop).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().contains(&addr.to_string()), "{e:?}");
        let source = std::error::Error::source(&e).expect("a source");
        assert!(source.is::<Unreachable>(), "{source:?}");
    }

    #[tokio::test]
    async fn an_executor_that_never_answers_is_held_to_the_call_s_deadline() {
        // Accepts connections and reads them, but never says anything.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let hop = Hop::Plain(Plain::new(&format!("http://{addr}").parse().unwrap()).unwrap());
        let mut req = tonic::Request::new(HealthCheckRequest::default());
        req.set_timeout(Duration::from_millis(200));
        let e = tokio::time::timeout(Duration::from_secs(30), HealthClient::new(hop).check(req))
            .await
            .expect("the call ends at its deadline")
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        assert!(e.message().contains(&addr.to_string()), "{e:?}");
    }
}
