//! Host-side client. Blocking std I/O; each call opens its own stream, so one
//! `AgentClient` can be shared across threads for concurrent calls.
//!
//! Everything the guest sends is treated as untrusted: frames are size-bounded
//! by [`crate::frame`], response types are checked against the call, and
//! sizes/names are validated before being handed to the caller.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use prost::Message;

use crate::frame::{encode_frame, read_frame_len, FrameError, CHUNK};
use crate::pb::{self, request, response::Kind};

/// The guest agent's vsock port.
pub const AGENT_PORT: u32 = crate::server::listen::VSOCK_PORT;

/// Upper bound on ListDir entries accepted from a guest.
const MAX_DIR_ENTRIES: usize = 1_000_000;

/// How long the agent may stall in the middle of a frame it is sending, and how long a write
/// to it may make no progress (a guest that stopped reading), before the call fails. The
/// agent writes each frame whole and reads as it goes, so only a hostile or wedged guest
/// comes near this; the gaps *between* frames are bounded by the call's own timeout (an exec
/// with a timeout gets this much longer to report its exit) or by its caller cancelling it
/// ([`Cancel`]).
pub const STALL_TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("connecting to {target}: {source}")]
    Connect { target: String, source: io::Error },
    #[error("vsock handshake with {target} (CONNECT {port}): {msg}")]
    Handshake {
        target: String,
        port: u32,
        msg: String,
    },
    #[error("talking to the agent: {0}")]
    Transport(#[from] FrameError),
    #[error("agent error: {0}")]
    Agent(String, AgentErrorCode),
    #[error("protocol violation by the agent: {0}")]
    Protocol(String),
    #[error("{what}: {source}")]
    Local {
        what: &'static str,
        source: io::Error,
    },
    #[error("agent warm-up `{command}` failed: {message}")]
    WarmupFailed { command: String, message: String },
    #[error("agent not ready after {waited:?}: {detail}")]
    NotReady { waited: Duration, detail: String },
    #[error("the agent stalled for {0:?} in the middle of a {1}-byte frame")]
    StalledFrame(Duration, usize),
    #[error("the agent read nothing of this call's data for {0:?}")]
    StoppedReading(Duration),
    #[error("no answer from the agent within {0:?}")]
    NoAnswer(Duration),
    #[error("the call was cancelled")]
    Cancelled,
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;

/// How an agent's error for a request it does not know begins (agents older than a request
/// answer it so, which is how a host tells them apart).
pub const UNKNOWN_REQUEST: &str = "unknown or missing request type";

impl ClientError {
    /// The agent does not know the request: it predates it.
    pub fn is_unknown_request(&self) -> bool {
        matches!(self, ClientError::Agent(m, _) if m.starts_with(UNKNOWN_REQUEST))
    }
}

/// The kind of failure the agent reported.
pub use pb::ErrorCode as AgentErrorCode;

/// How to reach the agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Connector {
    /// The agent listens on this Unix socket directly (`--listen unix:PATH`).
    Unix(PathBuf),
    /// The VMM's vsock Unix socket with a Firecracker-style handshake:
    /// `CONNECT <port>\n` → `OK <host port>\n`, then a raw stream to the guest.
    Vsock { uds: PathBuf, port: u32 },
}

impl Connector {
    pub fn vsock(uds: impl Into<PathBuf>) -> Self {
        Self::Vsock {
            uds: uds.into(),
            port: AGENT_PORT,
        }
    }

    /// Opens a fresh stream; `timeout` bounds the handshake (at most [`STALL_TIMEOUT`]: the
    /// guest kernel, not the agent, answers a connection request) and is left as the stream's
    /// read timeout. `first` is sent at once, as in [`connect_within`](Self::connect_within).
    pub fn connect(&self, timeout: Option<Duration>, first: &[u8]) -> Result<UnixStream> {
        let bound = timeout.map_or(STALL_TIMEOUT, |t| t.min(STALL_TIMEOUT));
        self.connect_within(bound, timeout, first)
    }

    /// [`connect`](Self::connect), with all of `bound` for the guest kernel to answer:
    /// for a call whose own timeout bounds it. A guest on an overloaded host can take longer
    /// than [`STALL_TIMEOUT`] to get to a connection request, and giving up only makes the
    /// caller connect again, to a guest with more to do.
    ///
    /// `first` (may be empty) is sent at once, before the VMM's `OK`: behind the CONNECT line
    /// in the same write. The VMM reads only the line and leaves what follows in the socket
    /// until the guest accepts, then gives it to the guest in the pass that takes the guest's
    /// answer, so a call's request does not wait for this side to hear `OK` and write it: one
    /// host round trip less per call. `first` must be small enough for an empty socket buffer
    /// to take whole ([`PIPELINED_MAX`]).
    pub fn connect_within(
        &self,
        bound: Duration,
        timeout: Option<Duration>,
        first: &[u8],
    ) -> Result<UnixStream> {
        debug_assert!(first.len() <= PIPELINED_MAX);
        let (path, port) = match self {
            Self::Unix(p) => (p, None),
            Self::Vsock { uds, port } => (uds, Some(*port)),
        };
        let target = path.display().to_string();
        let stream = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            target: target.clone(),
            source,
        })?;
        let set_timeout = |t: Option<Duration>| {
            stream
                .set_read_timeout(t)
                .map_err(|source| ClientError::Local {
                    what: "setting socket timeout",
                    source,
                })
        };
        match port {
            Some(port) => {
                set_timeout(Some(bound))?;
                handshake(&stream, port, bound, first).map_err(|msg| ClientError::Handshake {
                    target,
                    port,
                    msg,
                })?;
            }
            None if !first.is_empty() => {
                stream
                    .set_write_timeout(Some(bound))
                    .and_then(|()| (&stream).write_all(first))
                    .map_err(|e| ClientError::from(FrameError::Io(e)))?;
            }
            None => {}
        }
        set_timeout(timeout)?;
        Ok(stream)
    }
}

/// The largest request sent behind the CONNECT line, before the VMM's `OK` (a Unix socket's
/// send buffer takes far more; a request larger than this is sent after the `OK`).
const PIPELINED_MAX: usize = 16 * 1024;

fn handshake(
    mut stream: &UnixStream,
    port: u32,
    bound: Duration,
    first: &[u8],
) -> Result<(), String> {
    let mut out = format!("CONNECT {port}\n").into_bytes();
    out.extend_from_slice(first);
    let sent = stream
        .set_write_timeout(Some(bound))
        .and_then(|()| stream.write_all(&out));
    if let Err(e) = sent {
        // A VMM that refused the line may have closed already: its reply says why.
        return match read_reply_line(stream) {
            Ok(line) => Err(format!(
                "unexpected reply {:?}",
                String::from_utf8_lossy(&line)
            )),
            Err(_) => Err(format!("sending: {e}")),
        };
    }
    let line = read_reply_line(stream)?;
    let line = String::from_utf8_lossy(&line);
    if line.starts_with("OK ") {
        Ok(())
    } else {
        Err(format!("unexpected reply {line:?}"))
    }
}

/// The longest reply line a VMM sends to CONNECT (`OK <port>` or an `ERR` line).
const MAX_REPLY_LINE: usize = 64;

/// The VMM's reply line, without taking anything after it (the guest's data follows on the
/// same stream): what has arrived is peeked at and only the line is read, in two calls rather
/// than one per byte.
fn read_reply_line(mut stream: &UnixStream) -> Result<Vec<u8>, String> {
    let closed = || "VMM closed the connection (is the guest agent listening on that port?)";
    let mut line = Vec::new();
    let mut buf = [0u8; MAX_REPLY_LINE];
    while line.len() < MAX_REPLY_LINE {
        let room = MAX_REPLY_LINE - line.len();
        // SAFETY: recv writes at most `room` bytes into `buf`, which outlives the call.
        let n = unsafe {
            libc::recv(
                std::os::fd::AsRawFd::as_raw_fd(stream),
                buf.as_mut_ptr().cast(),
                room,
                libc::MSG_PEEK,
            )
        };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // A VMM that closes with the request sent behind the line still unread resets
            // the connection instead: the same refusal.
            if e.kind() == io::ErrorKind::ConnectionReset {
                return Err(closed().into());
            }
            return Err(format!("reading reply: {e}"));
        }
        let n = n as usize;
        if n == 0 {
            return Err(closed().into());
        }
        let end = buf[..n].iter().position(|b| *b == b'\n');
        let take = end.map_or(n, |i| i + 1);
        stream
            .read_exact(&mut buf[..take])
            .map_err(|e| format!("reading reply: {e}"))?;
        match end {
            Some(i) => {
                line.extend_from_slice(&buf[..i]);
                return Ok(line);
            }
            None => line.extend_from_slice(&buf[..n]),
        }
    }
    // As long as the longest reply: what it says is judged as it is.
    Ok(line)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    Ready,
    Warming,
    Failed(String),
}

/// The longest period between [`AgentClient::wait_ready`]'s pings.
pub const WAIT_READY_MAX_PERIOD: Duration = Duration::from_millis(100);

/// How long a caller that polls a guest (the pings of `wait_ready`) waits for each answer; a
/// clone's Wake does not poll, it waits until its deadline (executor/host, `make_ready`). A
/// connection refused or reset (no listener yet) fails at once and is retried soon; an attempt
/// that used its whole wait found a guest that is slow, not gone, so the next waits twice as
/// long. A fixed wait piles retries on an overloaded guest: it still serves each abandoned
/// call, on a thread of its own, and gets slower still (docs/performance.md, "Wake retries").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnswerWait {
    next: Duration,
}

impl Default for AnswerWait {
    fn default() -> Self {
        Self {
            next: Duration::from_secs(2),
        }
    }
}

impl AnswerWait {
    /// How long the next attempt may wait.
    pub fn next(&self) -> Duration {
        self.next
    }

    /// How long a caller that polls in slices (to notice a dead VMM between them) gives the
    /// next slice: 5 s, or the wait a slow guest has earned if longer, at most `left`.
    pub fn slice(&self, left: Duration) -> Duration {
        Duration::from_secs(5).max(self.next).min(left)
    }

    /// After an attempt that took `took` and brought no answer.
    pub fn after_failure(&mut self, took: Duration) {
        if took >= self.next {
            self.next = self.next.saturating_mul(2);
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PingInfo {
    pub agent_version: String,
    pub uptime: Duration,
    pub readiness: Readiness,
    /// The warm-up code configured in the guest ("" if none).
    pub warmup_command: String,
    /// How long the agent had been ready when it answered, by its own clock (None: not
    /// ready, or an agent that does not say). A clone's counts from its parent's warm-up.
    /// From the guest: a figure, never trusted for more than a measurement, and never more
    /// than `uptime`.
    pub ready_for: Option<Duration>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExecOptions {
    pub env: Vec<(String, String)>,
    pub cwd: Option<String>,
    pub stdin: Vec<u8>,
    pub timeout: Option<Duration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExitStatus {
    /// Exit code if the command exited normally.
    pub code: Option<i32>,
    /// Signal number if it was killed.
    pub signal: Option<i32>,
    /// The agent killed it (and its process group) at the timeout.
    pub timed_out: bool,
}

impl ExitStatus {
    pub fn success(&self) -> bool {
        self.code == Some(0) && !self.timed_out
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EvalOutcome {
    /// repr() of the final expression (None if there was none or it was None).
    pub value: Option<String>,
    pub stdout: String,
    pub stderr: String,
    /// Traceback if the code raised.
    pub error: Option<String>,
    /// Set when the interpreter had to be restarted (globals were lost).
    pub restarted: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileInfo {
    pub mode: u32,
    pub size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
    Unknown,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    pub name: String,
    pub kind: FileKind,
    pub size: u64,
    pub mode: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReseedOutcome {
    pub credited: bool,
    pub python_reseeded: Vec<String>,
    pub identity_set: bool,
}

/// What [`AgentClient::prepare_snapshot`] did: MemFree (KiB) before and after, the warm
/// interpreter's objects frozen (0 without one), and whether the agent had closed the call's
/// connection (so was done with it) within 2 s of its answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PreparedSnapshot {
    pub free_kib_before: u64,
    pub free_kib_after: u64,
    pub python_objects_frozen: u64,
    pub closed: bool,
}

/// What a [`AgentClient::wake`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WakeOutcome {
    pub ping: PingInfo,
    pub credited: bool,
    pub identity_set: bool,
    /// A warm interpreter runs and is reseeded before its next eval.
    pub python_reseed_pending: bool,
}

/// What makes a clone distinguishable inside: its hostname and machine-id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CloneIdentity {
    pub hostname: String,
    /// 32 lowercase hex digits (systemd's machine-id(5) format).
    pub machine_id: String,
}

impl CloneIdentity {
    /// `hostname` with a machine-id drawn from `random` (16 bytes).
    pub fn new(hostname: &str, random: [u8; 16]) -> CloneIdentity {
        CloneIdentity {
            hostname: hostname.to_string(),
            machine_id: random.iter().map(|b| format!("{b:02x}")).collect(),
        }
    }
}

/// Ends a client's calls from another thread: every stream they have open is shut down, so a
/// call blocked on a silent guest returns [`ClientError::Cancelled`] at once, and later calls
/// fail the same way. The executor cancels a call when whoever asked for it goes away.
#[derive(Debug, Clone, Default)]
pub struct Cancel(Arc<Mutex<Streams>>);

#[derive(Debug, Default)]
struct Streams {
    cancelled: bool,
    next: u64,
    open: HashMap<u64, UnixStream>,
}

impl Cancel {
    pub fn cancel(&self) {
        let mut st = self.0.lock().unwrap_or_else(|e| e.into_inner());
        st.cancelled = true;
        for s in st.open.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).cancelled
    }

    /// Cancels when the returned guard is dropped.
    pub fn on_drop(&self) -> CancelOnDrop {
        CancelOnDrop(self.clone())
    }

    fn register(&self, s: &UnixStream) -> Result<u64> {
        let clone = s.try_clone().map_err(|source| ClientError::Local {
            what: "keeping a handle to cancel the call",
            source,
        })?;
        let mut st = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if st.cancelled {
            return Err(ClientError::Cancelled);
        }
        st.next += 1;
        let id = st.next;
        st.open.insert(id, clone);
        Ok(id)
    }

    fn unregister(&self, id: u64) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .open
            .remove(&id);
    }
}

/// Cancels its [`Cancel`] when dropped (see [`Cancel::on_drop`]).
#[derive(Debug)]
pub struct CancelOnDrop(Cancel);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

/// One call's stream to the agent, known to its client's [`Cancel`] while it is open.
struct Call {
    stream: UnixStream,
    cancel: Option<(Cancel, u64)>,
    stall: Duration,
}

impl Drop for Call {
    fn drop(&mut self) {
        if let Some((c, id)) = &self.cancel {
            c.unregister(*id);
        }
    }
}

impl Call {
    fn cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|(c, _)| c.is_cancelled())
    }

    /// Bounds the wait for the next response (`None`: wait until it comes or the call is
    /// cancelled).
    fn wait_at_most(&self, t: Option<Duration>) -> Result<()> {
        self.stream
            .set_read_timeout(t.map(|t| t.max(Duration::from_millis(1))))
            .map_err(|source| ClientError::Local {
                what: "setting socket timeout",
                source,
            })
    }

    fn set_write_timeout(&self, t: Duration) -> Result<()> {
        self.stream
            .set_write_timeout(Some(t.max(Duration::from_millis(1))))
            .map_err(|source| ClientError::Local {
                what: "setting socket timeout",
                source,
            })
    }

    /// Writes one request frame. The whole frame must be taken within the stall timeout: a
    /// guest that reads a trickle is as stuck as one that reads nothing.
    fn send(&mut self, req: request::Kind) -> Result<()> {
        self.send_frame(&encode_frame(&pb::Request { kind: Some(req) })?)
    }

    /// [`send`](Self::send), of a frame already encoded.
    fn send_frame(&mut self, frame: &[u8]) -> Result<()> {
        let deadline = Instant::now() + self.stall;
        let mut off = 0;
        while off < frame.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ClientError::StoppedReading(self.stall));
            }
            self.set_write_timeout(left)?;
            match self.stream.write(&frame[off..]) {
                Ok(0) => return Err(FrameError::Io(io::ErrorKind::WriteZero.into()).into()),
                Ok(n) => off += n,
                Err(_) if self.cancelled() => return Err(ClientError::Cancelled),
                Err(e) if e.kind() == io::ErrorKind::Interrupted || timed_out(&e) => {}
                Err(e) => return Err(FrameError::Io(e).into()),
            }
        }
        Ok(())
    }

    /// After the answer: waits up to `limit` for the agent to close the connection, which it
    /// does once its handler is done with the call. Ok(false) if it did not in time.
    fn closed_within(&mut self, limit: Duration) -> Result<bool> {
        let io = |e: io::Error| ClientError::from(FrameError::Io(e));
        let before = self.stream.read_timeout().map_err(io)?;
        let limit = before.map_or(limit, |t| t.min(limit));
        self.stream.set_read_timeout(Some(limit)).map_err(io)?;
        let closed = match read_frame_len(&mut self.stream) {
            Err(FrameError::Closed) => Ok(true),
            Err(FrameError::Io(e)) if timed_out(&e) => Ok(false),
            Ok(_) => Err(ClientError::Protocol(
                "the agent sent more after its answer".into(),
            )),
            Err(e) => Err(e.into()),
        };
        self.stream.set_read_timeout(before).map_err(io)?;
        closed
    }

    /// Reads the next response; an agent `Error` becomes `ClientError::Agent`. The wait for
    /// a frame to begin is the stream's read timeout; once it began, the whole frame must
    /// arrive within the stall timeout (its buffer grows only as bytes do).
    fn recv(&mut self) -> Result<Kind> {
        let len = match read_frame_len(&mut self.stream) {
            Ok(len) => len,
            Err(_) if self.cancelled() => return Err(ClientError::Cancelled),
            Err(FrameError::Closed) => {
                return Err(ClientError::Protocol(
                    "agent closed the connection before answering".into(),
                ))
            }
            Err(FrameError::Io(e)) if timed_out(&e) => {
                return Err(match self.stream.read_timeout() {
                    Ok(Some(t)) => ClientError::NoAnswer(t),
                    _ => FrameError::Io(e).into(),
                })
            }
            Err(e) => return Err(e.into()),
        };
        let wait = self.stream.read_timeout().ok().flatten();
        let deadline = Instant::now() + self.stall;
        let mut body = Vec::with_capacity(len.min(CHUNK));
        while body.len() < len {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(ClientError::StalledFrame(self.stall, len));
            }
            self.wait_at_most(Some(left))?;
            // One read per turn, so the deadline is checked however the bytes trickle in.
            let start = body.len();
            body.resize(start + (len - start).min(CHUNK), 0);
            let got = self.stream.read(&mut body[start..]);
            body.truncate(start + *got.as_ref().unwrap_or(&0));
            match got {
                Ok(0) => return Err(FrameError::Io(io::ErrorKind::UnexpectedEof.into()).into()),
                Ok(_) => {}
                Err(_) if self.cancelled() => return Err(ClientError::Cancelled),
                Err(e) if e.kind() == io::ErrorKind::Interrupted || timed_out(&e) => {}
                Err(e) => return Err(FrameError::Io(e).into()),
            }
        }
        self.wait_at_most(wait)?;
        let resp = pb::Response::decode(body.as_slice())
            .map_err(|e| ClientError::Transport(FrameError::Decode(e)))?;
        match resp.kind {
            Some(Kind::Error(e)) => {
                let code = AgentErrorCode::try_from(e.code).unwrap_or(AgentErrorCode::Unspecified);
                Err(ClientError::Agent(e.message, code))
            }
            Some(k) => Ok(k),
            None => Err(ClientError::Protocol(
                "response of unknown type (agent newer than this client?)".into(),
            )),
        }
    }
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[derive(Debug, Clone)]
pub struct AgentClient {
    connector: Connector,
    io_timeout: Option<Duration>,
    stall: Duration,
    cancel: Option<Cancel>,
}

impl AgentClient {
    pub fn new(connector: Connector) -> Self {
        Self {
            connector,
            io_timeout: None,
            stall: STALL_TIMEOUT,
            cancel: None,
        }
    }

    /// Bounds every wait for the agent's answer (default: none, since exec and eval
    /// may legitimately run long; use their own timeouts, or [`Self::with_cancel`]).
    pub fn with_io_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.io_timeout = timeout;
        self
    }

    /// Replaces [`STALL_TIMEOUT`] (tests).
    pub fn with_stall_timeout(mut self, stall: Duration) -> Self {
        self.stall = stall;
        self
    }

    /// Lets `cancel` end this client's calls from another thread.
    pub fn with_cancel(mut self, cancel: Cancel) -> Self {
        self.cancel = Some(cancel);
        self
    }

    pub fn connector(&self) -> &Connector {
        &self.connector
    }

    fn open(&self, req: request::Kind, timeout: Option<Duration>) -> Result<Call> {
        if self.cancel.as_ref().is_some_and(Cancel::is_cancelled) {
            return Err(ClientError::Cancelled);
        }
        let started = Instant::now();
        // A small request goes with the connection request (see `Connector::connect_within`).
        let frame = encode_frame(&pb::Request { kind: Some(req) })?;
        let pipelined = frame.len() <= PIPELINED_MAX;
        let first = if pipelined { &frame[..] } else { &[] };
        let stream = match timeout {
            Some(t) => self.connector.connect_within(t, Some(t), first)?,
            None => self.connector.connect(self.io_timeout, first)?,
        };
        if let Some(t) = timeout {
            // A call's own timeout (ping, Wake) bounds all of it: what the handshake took is
            // not given again to the answer, so a caller's deadline holds.
            let left = t.saturating_sub(started.elapsed());
            stream
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .map_err(|source| ClientError::Local {
                    what: "setting socket timeout",
                    source,
                })?;
        }
        let cancel = match &self.cancel {
            Some(c) => Some((c.clone(), c.register(&stream)?)),
            None => None,
        };
        let mut call = Call {
            stream,
            cancel,
            stall: self.stall,
        };
        if !pipelined {
            call.send_frame(&frame)?;
        }
        Ok(call)
    }

    pub fn ping(&self) -> Result<PingInfo> {
        self.ping_within(Duration::from_secs(5))
    }

    fn ping_within(&self, timeout: Duration) -> Result<PingInfo> {
        let mut s = self.open(request::Kind::Ping(pb::PingRequest {}), Some(timeout))?;
        match s.recv()? {
            Kind::Ping(p) => ping_info(p),
            other => Err(unexpected("ping", &other)),
        }
    }

    /// Polls ping until the agent reports ready. Connection errors are
    /// retried (the guest may still be booting); a failed warm-up is
    /// returned immediately.
    pub fn wait_ready(&self, timeout: Duration) -> Result<PingInfo> {
        self.wait_ready_polling(timeout, Duration::from_millis(5), WAIT_READY_MAX_PERIOD)
    }

    /// Like [`Self::wait_ready`], polling every `first` at first and backing off to `max`.
    /// Readiness of a clone by separate calls polls from 1 ms so its time is not the backoff's.
    pub fn wait_ready_polling(
        &self,
        timeout: Duration,
        first: Duration,
        max: Duration,
    ) -> Result<PingInfo> {
        self.wait_ready_paced(timeout, first, max, &mut AnswerWait::default())
    }

    /// Like [`Self::wait_ready_polling`], with the wait for each answer carried across calls:
    /// a caller that polls in slices keeps what earlier slices learned about a slow guest.
    pub fn wait_ready_paced(
        &self,
        timeout: Duration,
        first: Duration,
        max: Duration,
        wait: &mut AnswerWait,
    ) -> Result<PingInfo> {
        let start = Instant::now();
        let mut backoff = first;
        let mut last: Option<Result<PingInfo>> = None;
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                break;
            }
            let tried = Instant::now();
            match self.ping_within(left.min(wait.next())) {
                Ok(p) => match &p.readiness {
                    Readiness::Ready => return Ok(p),
                    Readiness::Failed(msg) => {
                        return Err(ClientError::WarmupFailed {
                            command: p.warmup_command.clone(),
                            message: msg.clone(),
                        })
                    }
                    Readiness::Warming => last = Some(Ok(p)),
                },
                Err(e) => {
                    wait.after_failure(tried.elapsed());
                    last = Some(Err(e));
                }
            }
            std::thread::sleep(backoff.min(timeout.saturating_sub(start.elapsed())));
            backoff = (backoff * 2).min(max);
        }
        let detail = match last {
            Some(Ok(p)) => format!("still running warm-up `{}`", p.warmup_command),
            Some(Err(e)) => format!("last attempt failed: {e}"),
            None => "no attempt completed".into(),
        };
        Err(ClientError::NotReady {
            waited: start.elapsed(),
            detail,
        })
    }

    /// Runs `argv`, calling `on_stdout`/`on_stderr` with output as it arrives.
    pub fn exec<S: AsRef<str>>(
        &self,
        argv: &[S],
        opts: &ExecOptions,
        mut on_stdout: impl FnMut(&[u8]),
        mut on_stderr: impl FnMut(&[u8]),
    ) -> Result<ExitStatus> {
        let req = pb::ExecRequest {
            argv: argv.iter().map(|a| a.as_ref().to_owned()).collect(),
            env: opts
                .env
                .iter()
                .map(|(key, value)| pb::EnvVar {
                    key: key.clone(),
                    value: value.clone(),
                })
                .collect(),
            cwd: opts.cwd.clone().unwrap_or_default(),
            stdin: opts.stdin.clone(),
            timeout_ms: opts.timeout.map_or(0, |t| t.as_millis().max(1) as u64),
        };
        let mut s = self.open(request::Kind::Exec(req), None)?;
        // The agent kills the command at its timeout and then only has to report the exit,
        // which it gets the stall timeout for.
        let deadline = opts.timeout.map(|t| Instant::now() + t + self.stall);
        loop {
            if let Some(d) = deadline {
                let left = d.saturating_duration_since(Instant::now());
                s.wait_at_most(Some(self.io_timeout.map_or(left, |t| t.min(left))))?;
            }
            match s.recv()? {
                // The agent sends output in chunks of at most CHUNK; holding it to that bounds
                // what a caller's queue of chunks can hold.
                Kind::Stdout(c) | Kind::Stderr(c) if c.data.len() > CHUNK => {
                    return Err(ClientError::Protocol(format!(
                        "an output chunk of {} bytes (at most {CHUNK})",
                        c.data.len()
                    )))
                }
                Kind::Stdout(c) => on_stdout(&c.data),
                Kind::Stderr(c) => on_stderr(&c.data),
                Kind::Exit(e) => {
                    let (code, signal) = match e.how {
                        Some(pb::exit_status::How::Code(c)) => (Some(c), None),
                        Some(pb::exit_status::How::Signal(s)) => (None, Some(s)),
                        None => {
                            return Err(ClientError::Protocol(
                                "exit status has neither code nor signal".into(),
                            ))
                        }
                    };
                    return Ok(ExitStatus {
                        code,
                        signal,
                        timed_out: e.timed_out,
                    });
                }
                other => return Err(unexpected("exec", &other)),
            }
        }
    }

    /// `exec` collecting the output in memory.
    pub fn exec_output<S: AsRef<str>>(
        &self,
        argv: &[S],
        opts: &ExecOptions,
    ) -> Result<(ExitStatus, Vec<u8>, Vec<u8>)> {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let status = self.exec(
            argv,
            opts,
            |d| out.extend_from_slice(d),
            |d| err.extend_from_slice(d),
        )?;
        Ok((status, out, err))
    }

    /// Uploads `data` to `path` (atomically replaced in the guest). Returns
    /// the number of bytes the agent wrote.
    pub fn write_file(&self, path: &str, mode: u32, mut data: impl Read) -> Result<u64> {
        let req = pb::WriteFileRequest {
            path: path.to_owned(),
            mode,
            create_parents: false,
        };
        let mut s = self.open(request::Kind::WriteFile(req), None)?;
        let mut buf = vec![0u8; CHUNK];
        let mut sent = 0u64;
        loop {
            let n = read_full(&mut data, &mut buf).map_err(|source| ClientError::Local {
                what: "reading local data for upload",
                source,
            })?;
            let last = n < buf.len();
            let chunk = pb::FileChunk {
                data: buf[..n].to_vec(),
                last,
            };
            if let Err(e) = s.send(request::Kind::FileChunk(chunk)) {
                // The agent probably refused and hung up; prefer its reason, if it gives one
                // promptly (a guest that stopped reading may never answer).
                if matches!(e, ClientError::Transport(_)) {
                    s.wait_at_most(Some(s.stall))?;
                    if let Err(agent @ ClientError::Agent(..)) = s.recv() {
                        return Err(agent);
                    }
                }
                return Err(e);
            }
            sent += n as u64;
            if last {
                break;
            }
        }
        match s.recv()? {
            Kind::WriteFile(w) if w.size == sent => Ok(w.size),
            Kind::WriteFile(w) => Err(ClientError::Protocol(format!(
                "agent reports {} bytes written, {sent} were sent",
                w.size
            ))),
            other => Err(unexpected("write_file", &other)),
        }
    }

    /// Downloads `path` into `out`.
    pub fn read_file(&self, path: &str, mut out: impl Write) -> Result<FileInfo> {
        let req = pb::ReadFileRequest {
            path: path.to_owned(),
        };
        let mut s = self.open(request::Kind::ReadFile(req), None)?;
        let mut got = 0u64;
        loop {
            match s.recv()? {
                Kind::FileChunk(c) => {
                    got += c.data.len() as u64;
                    out.write_all(&c.data)
                        .map_err(|source| ClientError::Local {
                            what: "writing downloaded data",
                            source,
                        })?;
                }
                Kind::ReadFileDone(d) if d.size == got => {
                    out.flush().map_err(|source| ClientError::Local {
                        what: "writing downloaded data",
                        source,
                    })?;
                    return Ok(FileInfo {
                        mode: d.mode & 0o7777,
                        size: d.size,
                    });
                }
                Kind::ReadFileDone(d) => {
                    return Err(ClientError::Protocol(format!(
                        "agent reports {} bytes, {got} arrived",
                        d.size
                    )))
                }
                other => return Err(unexpected("read_file", &other)),
            }
        }
    }

    pub fn list_dir(&self, path: &str) -> Result<Vec<DirEntry>> {
        let req = pb::ListDirRequest {
            path: path.to_owned(),
        };
        let mut s = self.open(request::Kind::ListDir(req), None)?;
        let mut entries = Vec::new();
        loop {
            let batch = match s.recv()? {
                Kind::ListDir(b) => b,
                other => return Err(unexpected("list_dir", &other)),
            };
            for e in batch.entries {
                if e.name.is_empty() || e.name.contains(['/', '\0']) || e.name == ".." {
                    return Err(ClientError::Protocol(format!(
                        "invalid directory entry name {:?}",
                        e.name
                    )));
                }
                let kind = match pb::FileType::try_from(e.file_type) {
                    Ok(pb::FileType::File) => FileKind::File,
                    Ok(pb::FileType::Dir) => FileKind::Dir,
                    Ok(pb::FileType::Symlink) => FileKind::Symlink,
                    Ok(pb::FileType::Other) => FileKind::Other,
                    _ => FileKind::Unknown,
                };
                entries.push(DirEntry {
                    name: e.name,
                    kind,
                    size: e.size,
                    mode: e.mode & 0o7777,
                });
            }
            if entries.len() > MAX_DIR_ENTRIES {
                return Err(ClientError::Protocol(format!(
                    "more than {MAX_DIR_ENTRIES} directory entries"
                )));
            }
            if batch.done {
                return Ok(entries);
            }
        }
    }

    /// Evaluates Python in the guest's warm interpreter.
    pub fn eval(&self, code: &str) -> Result<EvalOutcome> {
        self.eval_with_timeout(code, None)
    }

    pub fn eval_with_timeout(&self, code: &str, timeout: Option<Duration>) -> Result<EvalOutcome> {
        let req = pb::EvalRequest {
            code: code.to_owned(),
            timeout_ms: timeout.map_or(0, |t| t.as_millis().max(1) as u64),
        };
        let mut s = self.open(request::Kind::Eval(req), None)?;
        match s.recv()? {
            Kind::Eval(e) => Ok(EvalOutcome {
                value: e.value,
                stdout: e.stdout,
                stderr: e.stderr,
                error: e.raised.then_some(e.traceback),
                restarted: (!e.restarted.is_empty()).then_some(e.restarted),
            }),
            other => Err(unexpected("eval", &other)),
        }
    }

    /// A clone's first call, in one exchange: set its clock to `time`, mix `entropy` into its
    /// kernel RNG, give it `identity`, and have its warm interpreter reseeded before its next
    /// eval; answers with what a ping says. `timeout` bounds the call, connecting included.
    /// An agent older than this call answers with an error for which
    /// [`ClientError::is_unknown_request`] holds.
    pub fn wake(
        &self,
        time: std::time::SystemTime,
        entropy: &[u8],
        identity: Option<&CloneIdentity>,
        timeout: Duration,
    ) -> Result<WakeOutcome> {
        let (hostname, machine_id) = identity_fields(identity);
        let mut s = self.open(
            request::Kind::Wake(pb::WakeRequest {
                unix_nanos: unix_nanos(time, "wake")?,
                entropy: entropy.to_vec(),
                hostname,
                machine_id,
            }),
            Some(timeout),
        )?;
        match s.recv()? {
            Kind::Wake(w) => Ok(WakeOutcome {
                ping: ping_info(w.ping.ok_or_else(|| {
                    ClientError::Protocol("a wake answer without its ping".into())
                })?)?,
                credited: w.credited,
                identity_set: w.identity_set,
                python_reseed_pending: w.python_reseed_pending,
            }),
            other => Err(unexpected("wake", &other)),
        }
    }

    /// Sets the guest's CLOCK_REALTIME.
    pub fn set_time(&self, time: std::time::SystemTime) -> Result<()> {
        let nanos = unix_nanos(time, "set_time")?;
        let mut s = self.open(
            request::Kind::SetTime(pb::SetTimeRequest { unix_nanos: nanos }),
            None,
        )?;
        match s.recv()? {
            Kind::SetTime(_) => Ok(()),
            other => Err(unexpected("set_time", &other)),
        }
    }

    /// Mixes `entropy` into the guest kernel RNG, reseeds the warm interpreter's
    /// `random`/`numpy.random` and, if given, sets the clone's `identity` (call after every
    /// clone).
    pub fn reseed(
        &self,
        entropy: &[u8],
        identity: Option<&CloneIdentity>,
    ) -> Result<ReseedOutcome> {
        let (hostname, machine_id) = identity_fields(identity);
        let mut s = self.open(
            request::Kind::Reseed(pb::ReseedRequest {
                entropy: entropy.to_vec(),
                hostname,
                machine_id,
            }),
            None,
        )?;
        match s.recv()? {
            Kind::Reseed(r) => Ok(ReseedOutcome {
                credited: r.credited,
                python_reseeded: r.python_reseeded,
                identity_set: r.identity_set,
            }),
            other => Err(unexpected("reseed", &other)),
        }
    }
}

impl AgentClient {
    /// Readies a parent for its snapshot: its warm interpreter collects and freezes its
    /// objects, and its kernel drops clean caches. An agent older than this call answers
    /// with an error for which [`ClientError::is_unknown_request`] holds.
    pub fn prepare_snapshot(&self) -> Result<PreparedSnapshot> {
        let mut s = self.open(
            request::Kind::PrepareSnapshot(pb::PrepareSnapshotRequest {}),
            None,
        )?;
        let r = match s.recv()? {
            Kind::PrepareSnapshot(r) => r,
            other => return Err(unexpected("prepare_snapshot", &other)),
        };
        // The snapshot follows at once: let the agent finish with this call first, so the
        // snapshot holds its handler idle (a clone then answers its first call on a thread it
        // already has). Not fatal: a snapshot taken meanwhile only costs clones a thread.
        let closed = s.closed_within(Duration::from_secs(2))?;
        Ok(PreparedSnapshot {
            free_kib_before: r.free_kib_before,
            free_kib_after: r.free_kib_after,
            python_objects_frozen: r.python_objects_frozen,
            closed,
        })
    }
}

/// The (hostname, machine_id) request fields for `identity` (empty: keep the parent's).
fn identity_fields(identity: Option<&CloneIdentity>) -> (String, String) {
    identity
        .map(|i| (i.hostname.clone(), i.machine_id.clone()))
        .unwrap_or_default()
}

fn unix_nanos(time: std::time::SystemTime, what: &'static str) -> Result<u64> {
    Ok(time
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| ClientError::Local {
            what,
            source: io::Error::new(io::ErrorKind::InvalidInput, "time before 1970"),
        })?
        .as_nanos() as u64)
}

fn ping_info(p: pb::PingResponse) -> Result<PingInfo> {
    let readiness = match pb::Readiness::try_from(p.readiness) {
        Ok(pb::Readiness::Ready) => Readiness::Ready,
        Ok(pb::Readiness::Warming) => Readiness::Warming,
        Ok(pb::Readiness::Failed) => Readiness::Failed(p.warmup_error),
        _ => {
            return Err(ClientError::Protocol(format!(
                "unknown readiness value {}",
                p.readiness
            )))
        }
    };
    let ready_for = match (&readiness, p.ready_ms) {
        (Readiness::Ready, Some(at)) if at <= p.uptime_ms => {
            Some(Duration::from_millis(p.uptime_ms - at))
        }
        _ => None,
    };
    Ok(PingInfo {
        agent_version: p.agent_version,
        uptime: Duration::from_millis(p.uptime_ms),
        readiness,
        warmup_command: p.warmup_command,
        ready_for,
    })
}

fn unexpected(call: &str, got: &Kind) -> ClientError {
    let name = match got {
        Kind::Ping(_) => "ping",
        Kind::Stdout(_) => "stdout",
        Kind::Stderr(_) => "stderr",
        Kind::Exit(_) => "exit",
        Kind::WriteFile(_) => "write_file",
        Kind::FileChunk(_) => "file_chunk",
        Kind::ReadFileDone(_) => "read_file_done",
        Kind::ListDir(_) => "list_dir",
        Kind::Eval(_) => "eval",
        Kind::SetTime(_) => "set_time",
        Kind::Reseed(_) => "reseed",
        Kind::PrepareSnapshot(_) => "prepare_snapshot",
        Kind::Wake(_) => "wake",
        Kind::Error(_) => "error",
    };
    ClientError::Protocol(format!("unexpected `{name}` response to {call}"))
}

/// Fills `buf` unless EOF comes first; returns the bytes read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::AnswerWait;
    use std::time::Duration;

    use super::read_reply_line;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    /// The reply line is read whole whether it comes in one piece or several, and the guest's
    /// data right behind it stays in the stream.
    #[test]
    fn the_reply_line_is_taken_and_nothing_after_it() {
        let whole: &[&[u8]] = &[b"OK 1024\nguest"];
        let split: &[&[u8]] = &[b"O", b"K 10", b"24\nguest"];
        for pieces in [whole, split] {
            let (ours, mut vmm) = UnixStream::pair().unwrap();
            let pieces: Vec<Vec<u8>> = pieces.iter().map(|p| p.to_vec()).collect();
            let writer = std::thread::spawn(move || {
                for p in pieces {
                    vmm.write_all(&p).unwrap();
                    std::thread::sleep(Duration::from_millis(20));
                }
                vmm
            });
            assert_eq!(read_reply_line(&ours).unwrap(), b"OK 1024");
            let _vmm = writer.join().unwrap();
            let mut rest = [0u8; 5];
            (&ours).read_exact(&mut rest).unwrap();
            assert_eq!(&rest, b"guest");
        }
        let (ours, vmm) = UnixStream::pair().unwrap();
        drop(vmm);
        assert!(read_reply_line(&ours).unwrap_err().contains("VMM closed"));
    }

    #[test]
    fn an_attempt_that_used_its_whole_wait_makes_the_next_wait_twice_as_long() {
        let s = Duration::from_secs;
        let mut w = AnswerWait::default();
        assert_eq!(w.next(), s(2));
        // Refused or reset at once: the guest is not there yet, the wait stays.
        w.after_failure(Duration::from_millis(3));
        assert_eq!(w.next(), s(2));
        w.after_failure(s(2));
        assert_eq!(w.next(), s(4));
        w.after_failure(s(4));
        assert_eq!(w.next(), s(8));
        w.after_failure(s(1));
        assert_eq!(w.next(), s(8));
        // A polling slice is as long as the earned wait, never past what is left.
        assert_eq!(w.slice(s(60)), s(8));
        assert_eq!(w.slice(s(3)), s(3));
        assert_eq!(AnswerWait::default().slice(s(60)), s(5));
    }
}
