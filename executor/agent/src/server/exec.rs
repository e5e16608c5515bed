//! Exec: run a command, stream its stdout/stderr as they arrive, then report
//! how it exited. Each pipe has its own reader thread feeding one channel, so
//! chunks stay in order per stream while the two streams interleave freely.

use std::io::{Read, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Command, Stdio};
use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use super::listen::Conn;
use super::reaper::spawn_owned;
use crate::frame::{write_message, CHUNK};
use crate::paths::validate_guest_path;
use crate::pb::{self, response::Kind};

/// PATH for commands when the agent's own environment has none (PID 1 starts
/// with an almost empty environment).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

enum Event {
    Stdout(Vec<u8>),
    Stderr(Vec<u8>),
    Eof,
    Exited(std::process::ExitStatus),
}

pub fn run(req: pb::ExecRequest, conn: &mut Conn) -> anyhow::Result<()> {
    let Some(program) = req.argv.first() else {
        bail!("exec: argv is empty");
    };
    let mut cmd = Command::new(program);
    cmd.args(&req.argv[1..]);
    if std::env::var_os("PATH").is_none() {
        cmd.env("PATH", DEFAULT_PATH);
    }
    for var in &req.env {
        if var.key.is_empty() || var.key.contains(['=', '\0']) || var.value.contains('\0') {
            bail!("exec: invalid environment variable {:?}", var.key);
        }
        cmd.env(&var.key, &var.value);
    }
    if !req.cwd.is_empty() {
        cmd.current_dir(validate_guest_path(&req.cwd).context("exec: cwd")?);
    }
    // Own process group, so a timeout can kill everything the command started.
    cmd.process_group(0)
        .stdin(if req.stdin.is_empty() {
            Stdio::null()
        } else {
            Stdio::piped()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn_owned(&mut cmd).with_context(|| format!("exec: spawning {program:?}"))?;
    let pid = child.id() as i32;

    let (tx, rx) = sync_channel::<Event>(32);
    if let Some(mut stdin) = child.stdin.take() {
        let data = req.stdin;
        std::thread::spawn(move || {
            // A command that exits without reading its stdin is not an error.
            let _ = stdin.write_all(&data);
        });
    }
    let stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    pump(stdout, tx.clone(), Event::Stdout);
    pump(stderr, tx.clone(), Event::Stderr);
    std::thread::spawn(move || {
        if let Ok(status) = child.wait() {
            let _ = tx.send(Event::Exited(status));
        }
    });

    let deadline =
        (req.timeout_ms > 0).then(|| Instant::now() + Duration::from_millis(req.timeout_ms));
    let mut open_streams = 2;
    let mut status = None;
    let mut timed_out = false;
    while open_streams > 0 || status.is_none() {
        let event = match deadline.filter(|_| !timed_out) {
            Some(d) => match rx.recv_timeout(d.saturating_duration_since(Instant::now())) {
                Ok(ev) => ev,
                Err(RecvTimeoutError::Timeout) => {
                    kill_group(pid);
                    timed_out = true;
                    continue;
                }
                Err(RecvTimeoutError::Disconnected) => break,
            },
            None => match rx.recv() {
                Ok(ev) => ev,
                Err(_) => break,
            },
        };
        let kind = match event {
            Event::Stdout(data) => Kind::Stdout(pb::OutputChunk { data }),
            Event::Stderr(data) => Kind::Stderr(pb::OutputChunk { data }),
            Event::Eof => {
                open_streams -= 1;
                continue;
            }
            Event::Exited(s) => {
                status = Some(s);
                continue;
            }
        };
        if let Err(e) = write_message(conn, &pb::Response { kind: Some(kind) }) {
            // The host went away: nobody will read the output, stop the command.
            kill_group(pid);
            return Err(e).context("exec: sending output");
        }
    }
    let status = status.context("exec: lost the child's exit status")?;
    let how = match (status.code(), status.signal()) {
        (Some(code), _) => Some(pb::exit_status::How::Code(code)),
        (None, Some(sig)) => Some(pb::exit_status::How::Signal(sig)),
        (None, None) => None,
    };
    write_message(
        conn,
        &pb::Response {
            kind: Some(Kind::Exit(pb::ExitStatus { how, timed_out })),
        },
    )?;
    Ok(())
}

fn pump(mut pipe: impl Read + Send + 'static, tx: SyncSender<Event>, wrap: fn(Vec<u8>) -> Event) {
    std::thread::spawn(move || {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if tx.send(wrap(buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        let _ = tx.send(Event::Eof);
    });
}

fn kill_group(pgid: i32) {
    // SAFETY: plain kill(2); ESRCH (already gone) is fine.
    unsafe {
        libc::kill(-pgid, libc::SIGKILL);
    }
}
