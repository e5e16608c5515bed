//! The transport of calls to one executor. For `http://` executors a call goes straight onto
//! the executor's HTTP/2 connection. tonic's `Channel` puts a buffer task in front of the
//! connection, so every call (and every spawn) waits for that task to be scheduled before the
//! request reaches the connection. Other addresses (`https://`) keep tonic's channel, which
//! brings the TLS set-up.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{Request, Response, Uri};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::transport::Channel;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long a new connection may take; tonic's endpoint had the same.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 pings on an idle connection, so one the network dropped is found.
const KEEP_ALIVE: Duration = Duration::from_secs(30);

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
            // Readiness is per call: it waits for the connection's stream capacity.
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
                Box::pin(async move { f.await.map_err(Into::into) })
            }
        }
    }
}

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
            }),
        })
    }

    fn live(&self) -> Option<SendRequest<Body>> {
        let live = self.inner.live.lock().unwrap_or_else(|p| p.into_inner());
        live.as_ref().filter(|s| !s.is_closed()).cloned()
    }

    async fn sender(&self) -> Result<SendRequest<Body>, BoxError> {
        if let Some(s) = self.live() {
            return Ok(s);
        }
        let _one = self.inner.connecting.lock().await;
        if let Some(s) = self.live() {
            return Ok(s);
        }
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
        *self.inner.live.lock().unwrap_or_else(|p| p.into_inner()) = Some(send.clone());
        Ok(send)
    }

    /// Errors before an answer are UNAVAILABLE and name the executor, as tonic's channel's
    /// transport errors are turned into where it matters ([`crate::api`]).
    async fn send(&self, req: Request<Body>) -> Result<Response<Body>, BoxError> {
        let addr = self.inner.authority.as_str();
        let unavailable = |what: &str, e: BoxError| {
            Box::new(tonic::Status::unavailable(format!(
                "executor {addr}: {what}: {e}"
            ))) as BoxError
        };
        let mut send = self
            .sender()
            .await
            .map_err(|e| unavailable("no connection", e))?;
        send.ready()
            .await
            .map_err(|e| unavailable("connection closed", e.into()))?;
        // HTTP/2 needs the scheme and authority on every request; tonic's client gives a path.
        let (mut head, body) = req.into_parts();
        let mut parts = std::mem::take(&mut head.uri).into_parts();
        parts.scheme = Some(Scheme::HTTP);
        parts.authority = Some(self.inner.authority.clone());
        head.uri = Uri::from_parts(parts)?;
        // tonic's channel holds a call to its deadline until the answer's headers; so does this.
        let deadline = head
            .headers
            .get("grpc-timeout")
            .and_then(|v| grpc_timeout(v.to_str().ok()?));
        let answer = send.send_request(Request::from_parts(head, body));
        let resp = match deadline {
            Some(d) => tokio::time::timeout(d, answer).await.map_err(|_| {
                tonic::Status::deadline_exceeded(format!(
                    "executor {addr}: no answer within the call's deadline of {d:?}"
                ))
            })?,
            None => answer.await,
        }
        .map_err(|e| unavailable("no answer", e.into()))?;
        Ok(resp.map(Body::new))
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

    /// A gRPC server (the health service) on `listener` until `stop` fires.
    fn serve(
        listener: tokio::net::TcpListener,
        stop: tokio::sync::oneshot::Receiver<()>,
    ) -> tokio::task::JoinHandle<()> {
        let (_reporter, health) = tonic_health::server::health_reporter();
        tokio::spawn(async move {
            tonic::transport::Server::builder()
                .add_service(health)
                .serve_with_incoming_shutdown(
                    tokio_stream::wrappers::TcpListenerStream::new(listener),
                    async {
                        let _ = stop.await;
                    },
                )
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
    async fn calls_go_direct_and_reconnect_after_the_executor_restarts() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let server = serve(listener, stopped);
        let hop = Hop::Plain(Plain::new(&format!("http://{addr}").parse().unwrap()).unwrap());
        for _ in 0..3 {
            assert_eq!(check(&hop).await.unwrap(), 1, "SERVING");
        }

        stop.send(()).unwrap();
        server.await.unwrap();
        let e = check(&hop).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().contains(&addr.to_string()), "{e:?}");

        // The executor comes back on the same address: the next call connects anew.
        let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let server = serve(listener, stopped);
        assert_eq!(check(&hop).await.unwrap(), 1);
        stop.send(()).unwrap();
        server.await.unwrap();
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
