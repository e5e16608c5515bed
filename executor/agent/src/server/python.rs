//! The warm, long-lived Python interpreter behind Eval.
//!
//! One interpreter per agent, driven over its stdin/stdout by the embedded
//! `driver.py`. Evals are serialised by a mutex (one interpreter, one global
//! namespace). If the interpreter dies or an eval times out, it is restarted
//! (re-running the warm-up) and the next response says so.

use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::reaper::{spawn_owned, OwnedChild};
use crate::pb;

const DRIVER: &str = include_str!("driver.py");

/// Cap per captured field so a reply always fits in one frame.
const MAX_FIELD: usize = 1024 * 1024;

struct Proc {
    child: OwnedChild,
    stdin: ChildStdin,
    stdout: ChildStdout,
}

impl Drop for Proc {
    fn drop(&mut self) {
        // SAFETY: kill(2) on the driver's own process group.
        unsafe {
            libc::kill(-(self.child.id() as i32), libc::SIGKILL);
        }
        let _ = self.child.wait();
    }
}

/// What the driver answered.
pub struct Reply {
    pub status: u8,
    pub value: String,
    pub stdout: String,
    pub stderr: String,
    pub traceback: String,
}

#[derive(Default)]
struct State {
    proc: Option<Proc>,
    /// Why the previous interpreter is gone, reported with the next eval.
    lost: Option<String>,
    /// This clone was woken with fresh entropy and the interpreter still holds its parent's
    /// random state: reseed it before the next eval runs.
    reseed_pending: bool,
}

pub struct Interpreter {
    python: PathBuf,
    warmup: String,
    state: Mutex<State>,
}

impl Interpreter {
    pub fn new(python: PathBuf, warmup: String) -> Self {
        Self {
            python,
            warmup,
            state: Mutex::new(State::default()),
        }
    }

    pub fn warmup_code(&self) -> &str {
        &self.warmup
    }

    /// Starts the interpreter and runs the warm-up; `Err` carries the reason
    /// (spawn error or the warm-up's traceback).
    pub fn warm_up(&self) -> anyhow::Result<()> {
        let mut st = self.lock();
        self.ensure_running(&mut st)?
            .map_or(Ok(()), |e| Err(anyhow::anyhow!(e)))
    }

    pub fn eval(&self, code: &str, timeout: Option<Duration>) -> anyhow::Result<pb::EvalResponse> {
        let mut st = self.lock();
        if std::mem::take(&mut st.reseed_pending) {
            // A failure leaves the reason in `lost`; the interpreter started next has fresh
            // random state of its own, and this eval reports the restart.
            if let Err(e) = reseed_locked(&mut st) {
                eprintln!("tine-agent: {e:#}");
            }
        }
        let warm = self.ensure_running(&mut st)?;
        let mut restarted = st
            .lost
            .take()
            .map(|why| format!("{why}; interpreter restarted, globals lost"));
        if let Some(warm_err) = warm {
            let note = format!("warm-up failed after restart: {warm_err}");
            restarted = Some(restarted.map_or(note.clone(), |r| format!("{r}; {note}")));
        }
        let proc = st.proc.as_mut().expect("ensure_running started it");
        let deadline = timeout.map(|t| Instant::now() + t);
        match request(proc, b'E', code, deadline) {
            Ok(r) => Ok(pb::EvalResponse {
                value: (r.status == b'V').then_some(r.value),
                stdout: r.stdout,
                stderr: r.stderr,
                raised: r.status == b'X',
                traceback: r.traceback,
                restarted: restarted.unwrap_or_default(),
            }),
            Err(e) => {
                let why = if e.kind() == io::ErrorKind::TimedOut {
                    format!(
                        "eval timed out after {} ms; interpreter killed",
                        timeout.unwrap_or_default().as_millis()
                    )
                } else {
                    let mut p = st.proc.take().expect("present");
                    let status = p.child.try_wait().ok().flatten();
                    format!("interpreter died during eval ({e}; exit status {status:?})")
                };
                st.proc = None;
                // Restart right away so the warm state is back before the next call.
                let restart = match self.ensure_running(&mut st) {
                    Ok(None) => format!("{why}; restarted, globals lost"),
                    Ok(Some(w)) => format!("{why}; restarted, globals lost; warm-up failed: {w}"),
                    Err(e) => {
                        st.lost = Some(why.clone());
                        format!("{why}; restart failed: {e:#}")
                    }
                };
                Ok(pb::EvalResponse {
                    raised: true,
                    traceback: format!("{why}\n"),
                    restarted: restart,
                    ..Default::default()
                })
            }
        }
    }

    /// Tells a running interpreter to reseed `random`/`numpy.random`; does not
    /// start one just for that. Returns the modules reseeded. An interpreter that fails
    /// meanwhile is an error: the clone's warm state is gone, and it must not be reported
    /// ready as if it were there.
    pub fn reseed(&self) -> anyhow::Result<Vec<String>> {
        let mut st = self.lock();
        st.reseed_pending = false;
        reseed_locked(&mut st)
    }

    /// Readies a running interpreter for a snapshot: a full collection, then every object moved
    /// out of the collector's reach (`gc.freeze()`), so clones' collections do not write across
    /// the heap they share with their parent. Returns the objects frozen (None: no
    /// interpreter runs). An interpreter that fails meanwhile is lost, as in a reseed.
    pub fn prepare_snapshot(&self) -> anyhow::Result<Option<u64>> {
        let mut st = self.lock();
        let Some(r) = request_or_lose(&mut st, b'P', "while preparing for a snapshot")? else {
            return Ok(None);
        };
        Ok(Some(r.value.trim().parse().with_context(|| {
            format!("the interpreter answered {:?} to a freeze", r.value)
        })?))
    }

    /// Marks a running interpreter to be reseeded before its next eval, and returns whether
    /// one runs. A woken clone answers without waiting for Python: the reseed makes the
    /// interpreter run and touch its heap, which costs a fresh clone time (its pages fault in)
    /// and memory (they become its own), so a clone that never evaluates never pays it.
    pub fn reseed_before_next_eval(&self) -> bool {
        let mut st = self.lock();
        st.reseed_pending = st.proc.is_some();
        st.reseed_pending
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes sure an interpreter is running. Returns `Some(msg)` if a fresh
    /// one was started and its warm-up raised.
    fn ensure_running(&self, st: &mut State) -> anyhow::Result<Option<String>> {
        if let Some(p) = st.proc.as_mut() {
            match p.child.try_wait() {
                Ok(None) => return Ok(None),
                Ok(Some(status)) => {
                    st.lost
                        .get_or_insert(format!("interpreter exited ({status})"));
                }
                Err(e) => {
                    st.lost.get_or_insert(format!("interpreter lost ({e})"));
                }
            }
            st.proc = None;
        }
        let mut cmd = Command::new(&self.python);
        cmd.arg("-c")
            .arg(DRIVER)
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child =
            spawn_owned(&mut cmd).with_context(|| format!("starting {}", self.python.display()))?;
        let mut proc = Proc {
            stdin: child.stdin.take().expect("piped"),
            stdout: child.stdout.take().expect("piped"),
            child,
        };
        let mut warm_err = None;
        if !self.warmup.trim().is_empty() {
            let r = request(&mut proc, b'E', &self.warmup, None)
                .with_context(|| format!("running warm-up in {}", self.python.display()))?;
            if r.status == b'X' {
                warm_err = Some(r.traceback);
            }
        }
        st.proc = Some(proc);
        // A new process drew its own seeds.
        st.reseed_pending = false;
        Ok(warm_err)
    }
}

/// Tells a running interpreter to reseed `random`/`numpy.random`; does not start one just for
/// that. Returns the modules reseeded. An interpreter that fails meanwhile is an error: the
/// clone's warm state is gone (recorded in `lost`).
fn reseed_locked(st: &mut State) -> anyhow::Result<Vec<String>> {
    let Some(r) = request_or_lose(st, b'R', "during reseed")? else {
        return Ok(Vec::new());
    };
    Ok(r.value
        .split(',')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect())
}

/// Sends `op` (no payload) to a running interpreter; None if none runs. An interpreter that
/// fails to answer is gone, and why (`what`: when it failed) is recorded in `lost`.
fn request_or_lose(st: &mut State, op: u8, what: &str) -> anyhow::Result<Option<Reply>> {
    let Some(proc) = st.proc.as_mut() else {
        return Ok(None);
    };
    // A fresh clone faults its interpreter's pages in as it runs: on a loaded host (or the
    // nested lab) that takes seconds. The host's deadline bounds the wait; this one only
    // catches an interpreter that is stuck for good.
    match request(
        proc,
        op,
        "",
        Some(Instant::now() + Duration::from_secs(300)),
    ) {
        Ok(r) => Ok(Some(r)),
        Err(e) => {
            let why = format!("interpreter failed {what} ({e})");
            st.proc = None;
            st.lost = Some(why.clone());
            anyhow::bail!("{why}; its warm state is lost")
        }
    }
}

fn request(proc: &mut Proc, op: u8, payload: &str, deadline: Option<Instant>) -> io::Result<Reply> {
    let mut msg = Vec::with_capacity(5 + payload.len());
    msg.push(op);
    msg.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    msg.extend_from_slice(payload.as_bytes());
    proc.stdin.write_all(&msg)?;
    proc.stdin.flush()?;
    let mut status = [0u8; 1];
    read_exact_by(&mut proc.stdout, &mut status, deadline)?;
    let mut fields = Vec::with_capacity(4);
    for _ in 0..4 {
        let mut len = [0u8; 4];
        read_exact_by(&mut proc.stdout, &mut len, deadline)?;
        let len = u32::from_be_bytes(len) as usize;
        let mut buf = vec![0u8; len];
        read_exact_by(&mut proc.stdout, &mut buf, deadline)?;
        fields.push(truncate(buf));
    }
    let mut it = fields.into_iter();
    let mut next = || it.next().unwrap_or_default();
    Ok(Reply {
        status: status[0],
        value: next(),
        stdout: next(),
        stderr: next(),
        traceback: next(),
    })
}

fn truncate(mut buf: Vec<u8>) -> String {
    let total = buf.len();
    if total <= MAX_FIELD {
        return String::from_utf8_lossy(&buf).into_owned();
    }
    buf.truncate(MAX_FIELD);
    format!(
        "{}\n[... truncated, {} of {total} bytes shown]",
        String::from_utf8_lossy(&buf),
        MAX_FIELD
    )
}

/// `read_exact` that gives up with `TimedOut` at `deadline`.
fn read_exact_by(
    r: &mut ChildStdout,
    mut buf: &mut [u8],
    deadline: Option<Instant>,
) -> io::Result<()> {
    while !buf.is_empty() {
        if let Some(d) = deadline {
            let left = d.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(io::ErrorKind::TimedOut.into());
            }
            let mut pfd = libc::pollfd {
                fd: r.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
            // SAFETY: poll on one valid pollfd.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if rc == 0 {
                continue; // loop re-checks the deadline
            }
        }
        match r.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => buf = &mut buf[n..],
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `random.random()` right after `random.seed(42)`.
    const FIRST_AFTER_SEED_42: &str = "0.6394267984578837";

    fn seeded() -> Interpreter {
        let i = Interpreter::new("python3".into(), "import random; random.seed(42)".into());
        i.warm_up().unwrap();
        i
    }

    #[test]
    fn a_woken_clone_s_interpreter_is_reseeded_before_its_next_eval() {
        // The control: without the mark the parent's state carries on.
        let parent = seeded();
        let v = parent.eval("random.random()", None).unwrap().value;
        assert_eq!(v.as_deref(), Some(FIRST_AFTER_SEED_42));

        let clone = seeded();
        assert!(clone.reseed_before_next_eval());
        let r = clone.eval("random.random()", None).unwrap();
        assert!(r.value.is_some() && r.restarted.is_empty(), "{r:?}");
        assert_ne!(r.value.as_deref(), Some(FIRST_AFTER_SEED_42));
        // Once: the mark is gone with that eval, and its globals are still there.
        assert!(!clone.lock().reseed_pending);
        let r = clone
            .eval("random.seed(42); random.random()", None)
            .unwrap();
        assert_eq!(r.value.as_deref(), Some(FIRST_AFTER_SEED_42));
    }

    #[test]
    fn a_prepared_interpreter_has_its_objects_frozen_and_keeps_its_state() {
        let i = seeded();
        i.eval("kept = [object() for _ in range(1000)]", None)
            .unwrap();
        let frozen = i.prepare_snapshot().unwrap().expect("an interpreter runs");
        assert!(frozen >= 1000, "{frozen}");
        let r = i
            .eval(
                "import gc; (gc.get_freeze_count() >= 1000, len(kept))",
                None,
            )
            .unwrap();
        assert_eq!(r.value.as_deref(), Some("(True, 1000)"));
        assert_eq!(
            Interpreter::new("python3".into(), String::new())
                .prepare_snapshot()
                .unwrap(),
            None
        );
    }

    #[test]
    fn no_interpreter_no_pending_reseed() {
        let i = Interpreter::new("python3".into(), String::new());
        assert!(!i.reseed_before_next_eval());
    }
}
