//! The gate in front of a gRPC service: every call is authenticated and authorised on its
//! headers, before any of its body is read, and its body is held to a per-call limit as it
//! arrives (a message whose length prefix is over it is refused RESOURCE_EXHAUSTED without
//! being buffered). Calls that never reach their handler (refused here, oversized,
//! undecodable, shed) are reported to the service's [`Gatekeeper`], so they are audited and
//! counted like the others.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::body::Body;
use tonic::transport::server::TcpConnectInfo;
use tonic::Status;
use tower::{Layer, Service};

use crate::auth::Principal;

/// Body limit of calls to services that are not gated (health, reflection).
pub const OPEN_BODY_LIMIT: usize = 64 << 10;

/// What the gate does with a call, decided on its path and headers alone.
pub enum Verdict {
    /// Not a gated service (health checks, reflection): served as is, bodies bounded by
    /// [`OPEN_BODY_LIMIT`].
    Open,
    /// Let through; each message of its body may be at most `body_limit` bytes.
    Admit {
        principal: Principal,
        body_limit: usize,
    },
    /// Answered with `status` at once; nothing of the body is read.
    Refuse {
        principal: Option<String>,
        status: Status,
    },
}

/// A call that ended before its handler began.
pub struct Refused<'a> {
    pub path: &'a str,
    pub principal: Option<&'a str>,
    pub status: &'a Status,
    pub peer: Option<SocketAddr>,
    pub elapsed: Duration,
}

/// The service-specific half of the gate: who may call what, and where refusals go.
pub trait Gatekeeper: Send + Sync + 'static {
    fn admit(&self, path: &str, headers: &http::HeaderMap) -> Verdict;
    /// Record a call that never reached its handler (called at most once per call).
    fn refused(&self, call: Refused<'_>);
}

/// What the gate knows of an admitted call, put in the request's extensions: the handler
/// takes the principal from here (rather than authenticating again) and says it began.
#[derive(Clone)]
pub struct Gated {
    pub principal: Principal,
    call: Arc<CallState>,
}

impl Gated {
    /// The handler has the call: from here on it audits the outcome itself.
    pub fn begin(&self) {
        self.call.begun.store(true, Ordering::SeqCst);
    }
}

struct CallState {
    keeper: Arc<dyn Gatekeeper>,
    path: String,
    principal: Option<String>,
    peer: Option<SocketAddr>,
    start: Instant,
    begun: AtomicBool,
    reported: AtomicBool,
}

impl CallState {
    /// Report `status` unless the handler has the call or it was reported already.
    fn refused(&self, status: &Status) {
        if self.begun.load(Ordering::SeqCst) || self.reported.swap(true, Ordering::SeqCst) {
            return;
        }
        self.keeper.refused(Refused {
            path: &self.path,
            principal: self.principal.as_deref(),
            status,
            peer: self.peer,
            elapsed: self.start.elapsed(),
        });
    }
}

/// The peer of a call, over plain TCP or TLS.
pub fn peer_of(ext: &http::Extensions) -> Option<SocketAddr> {
    ext.get::<TcpConnectInfo>()
        .and_then(|i| i.remote_addr())
        .or_else(|| {
            ext.get::<tonic::transport::server::TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.get_ref().remote_addr())
        })
}

/// `Server::builder().layer(GateLayer::new(keeper))`.
#[derive(Clone)]
pub struct GateLayer {
    keeper: Arc<dyn Gatekeeper>,
}

impl GateLayer {
    pub fn new(keeper: Arc<dyn Gatekeeper>) -> GateLayer {
        GateLayer { keeper }
    }
}

impl<S> Layer<S> for GateLayer {
    type Service = Gate<S>;
    fn layer(&self, inner: S) -> Gate<S> {
        Gate {
            inner,
            keeper: self.keeper.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Gate<S> {
    inner: S,
    keeper: Arc<dyn Gatekeeper>,
}

type GateFuture<E> = Pin<Box<dyn Future<Output = Result<http::Response<Body>, E>> + Send>>;

impl<S> Service<http::Request<Body>> for Gate<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = GateFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let start = Instant::now();
        let path = req.uri().path().to_string();
        let peer = peer_of(req.extensions());
        let (principal, limit) = match self.keeper.admit(&path, req.headers()) {
            Verdict::Refuse { principal, status } => {
                self.keeper.refused(Refused {
                    path: &path,
                    principal: principal.as_deref(),
                    status: &status,
                    peer,
                    elapsed: start.elapsed(),
                });
                return Box::pin(async move { Ok(status.into_http()) });
            }
            Verdict::Open => (None, OPEN_BODY_LIMIT),
            Verdict::Admit {
                principal,
                body_limit,
            } => (Some(principal), body_limit),
        };
        let call = Arc::new(CallState {
            keeper: self.keeper.clone(),
            path,
            principal: principal.as_ref().map(|p| p.name.clone()),
            peer,
            start,
            begun: AtomicBool::new(false),
            reported: AtomicBool::new(false),
        });
        let (mut parts, body) = req.into_parts();
        if let Some(principal) = principal {
            parts.extensions.insert(Gated {
                principal,
                call: call.clone(),
            });
        }
        let body = Body::new(Limited {
            inner: body,
            limit,
            framing: Framing::default(),
            call: call.clone(),
            failed: false,
        });
        // The ready service is taken; a fresh clone waits for the next call's poll_ready.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let resp = inner.call(http::Request::from_parts(parts, body)).await?;
            // A trailers-only answer from before the handler (undecodable, shed, unknown).
            if let Some(status) = Status::from_header_map(resp.headers()) {
                if status.code() != tonic::Code::Ok {
                    call.refused(&status);
                }
            }
            Ok(resp)
        })
    }
}

/// Where the reader is in the gRPC length-prefixed framing of a body.
#[derive(Default)]
struct Framing {
    prefix: [u8; 5],
    have: usize,
    payload_left: u64,
}

impl Framing {
    /// Walk `chunk`; the length of the first message over `limit`, if one starts here.
    fn over(&mut self, mut chunk: &[u8], limit: usize) -> Option<u64> {
        while !chunk.is_empty() {
            if self.payload_left > 0 {
                let take = self.payload_left.min(chunk.len() as u64);
                self.payload_left -= take;
                chunk = &chunk[take as usize..];
                continue;
            }
            self.prefix[self.have] = chunk[0];
            self.have += 1;
            chunk = &chunk[1..];
            if self.have == 5 {
                self.have = 0;
                let len = u32::from_be_bytes([
                    self.prefix[1],
                    self.prefix[2],
                    self.prefix[3],
                    self.prefix[4],
                ]) as u64;
                if len > limit as u64 {
                    return Some(len);
                }
                self.payload_left = len;
            }
        }
        None
    }
}

/// A request body held to `limit` bytes per gRPC message.
struct Limited {
    inner: Body,
    limit: usize,
    framing: Framing,
    call: Arc<CallState>,
    failed: bool,
}

impl HttpBody for Limited {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let frame = match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        if let Some(data) = frame.data_ref() {
            let limit = self.limit;
            if let Some(len) = self.framing.over(data.chunk(), limit) {
                self.failed = true;
                let status = Status::resource_exhausted(format!(
                    "{}: a message of {len} bytes is over this call's limit of {limit} bytes",
                    self.call.path
                ));
                self.call.refused(&status);
                return Poll::Ready(Some(Err(status)));
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(len: u32) -> Vec<u8> {
        let mut v = vec![0u8];
        v.extend_from_slice(&len.to_be_bytes());
        v.extend(std::iter::repeat_n(7u8, len as usize));
        v
    }

    #[test]
    fn framing_finds_an_oversized_prefix_however_the_body_is_cut() {
        let mut body = frame(10);
        body.extend(frame(100));
        body.extend(frame(1000));
        for cut in [1, 2, 3, 5, 7, 64, 4096] {
            let mut f = Framing::default();
            let found = body.chunks(cut).find_map(|c| f.over(c, 500));
            assert_eq!(found, Some(1000), "chunks of {cut}");
            let mut f = Framing::default();
            assert_eq!(body.chunks(cut).find_map(|c| f.over(c, 1000)), None);
        }
    }
}
