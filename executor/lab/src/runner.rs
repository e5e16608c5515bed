//! Booting L1 for one command: spawn QEMU, stream the console, enforce the timeout.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::console::{ConsoleFilter, Event};
use crate::job::Job;
use crate::qemu::{self, QemuConfig};
use crate::{Lab, LabCommand};

/// How a lab run went, when the command ran to completion.
#[derive(Debug, Clone)]
pub struct LabOutcome {
    /// The command's exit status (128+N when killed by signal N).
    pub exit_code: i32,
    /// Wall-clock time from starting QEMU until L1's /init ran.
    pub l1_init: Option<Duration>,
    /// L1's own uptime when /init ran (seconds).
    pub l1_init_uptime: Option<f64>,
    /// Wall-clock time until modules and mounts were ready and the command started.
    pub l1_ready: Option<Duration>,
    /// Wall-clock time of the whole run.
    pub total: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum LabError {
    #[error("L1 did not finish within {timeout:?}; QEMU killed. Console (last lines):\n{console}")]
    Timeout { timeout: Duration, console: String },
    #[error("L1 setup failed: {step}. Console (last lines):\n{console}")]
    SetupFailed { step: String, console: String },
    #[error(
        "L1 stopped ({status}) without reporting the command's exit status.\n\
         Console (last lines):\n{console}\nQEMU stderr:\n{stderr}"
    )]
    NoExitStatus {
        status: String,
        console: String,
        stderr: String,
    },
}

/// How long QEMU gets to power off after the command's exit status arrived.
const POWEROFF_GRACE: Duration = Duration::from_secs(30);

fn nonce() -> Result<String> {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .context("reading /dev/urandom")?;
    Ok(hex::encode(b))
}

/// The last `lines` lines of console text, without terminal escape sequences (SeaBIOS clears
/// the screen) and blank lines.
fn tail(text: &str, lines: usize) -> String {
    let mut clean = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\x1b' => {
                // ESC [ params final-byte, or a two-character ESC sequence.
                if chars.next_if_eq(&'[').is_some() {
                    while chars.next().is_some_and(|c| !c.is_ascii_alphabetic()) {}
                } else {
                    chars.next();
                }
            }
            '\n' | '\t' => clean.push(c),
            c if c.is_control() => {}
            c => clean.push(c),
        }
    }
    let all: Vec<&str> = clean.lines().filter(|l| !l.trim().is_empty()).collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn spawn_qemu(args: Vec<std::ffi::OsString>) -> Result<Child> {
    let mut cmd = Command::new(qemu::QEMU);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SAFETY: prctl is async-signal-safe; it only makes the kernel kill QEMU if we die, so no
    // TCG run outlives its caller.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
        .with_context(|| format!("starting {} (package qemu-system-x86)", qemu::QEMU))
}

impl Lab {
    /// Boots L1, runs `cmd`, streams its output (stdout and stderr merged, via the serial
    /// console) into `sink`. Errors with a [`LabError`] when L1 fails or times out.
    pub fn run(&self, cmd: &LabCommand, sink: &mut dyn Write) -> Result<LabOutcome> {
        let cwd = match &cmd.cwd {
            Some(c) => c.clone(),
            None => std::env::current_dir().context("reading the current directory")?,
        };
        // Tells tine inside that the host's files (its cache too) are read-only there.
        let mut env = cmd.env.clone();
        env.retain(|(k, _)| k != tine_image::cache::IN_LAB_ENV);
        env.push((tine_image::cache::IN_LAB_ENV.into(), "1".into()));
        let job = Job {
            argv: cmd.argv.clone(),
            cwd,
            env,
            shares: self.shares.clone(),
        };
        let nonce = nonce()?;
        let tmp = tempfile::Builder::new()
            .prefix("tine-lab-")
            .tempdir()
            .context("creating a temporary directory")?;
        let initrd = tmp.path().join("initrd");
        job.write_initrd(&nonce, &self.initramfs, &initrd)?;

        let args = qemu::args(&QemuConfig {
            kernel: &self.kernel.vmlinuz,
            initrd: &initrd,
            mem_mib: self.config.mem_mib,
            cpus: self.config.cpus,
            shares: &self.shares,
            kernel_args: &self.config.kernel_args,
        });
        let started = Instant::now();
        let mut child = spawn_qemu(args)?;
        let result = self.supervise(&mut child, &nonce, started, sink);
        // Whatever happened, no QEMU is left running.
        if !matches!(child.try_wait(), Ok(Some(_))) {
            let _ = child.kill();
            let _ = child.wait();
        }
        result
    }

    fn supervise(
        &self,
        child: &mut Child,
        nonce: &str,
        started: Instant,
        sink: &mut dyn Write,
    ) -> Result<LabOutcome> {
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let mut stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 16 * 1024];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        let mut stderr = child.stderr.take().expect("piped stderr");
        let stderr_thread = std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = stderr.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        });

        let progress = self.config.progress;
        let mut filter = ConsoleFilter::new(nonce);
        let mut outcome = LabOutcome {
            exit_code: -1,
            l1_init: None,
            l1_init_uptime: None,
            l1_ready: None,
            total: Duration::ZERO,
        };
        let mut exit: Option<i32> = None;
        let deadline = started + self.config.timeout;
        loop {
            let wait_until = match exit {
                Some(_) => deadline.min(Instant::now() + POWEROFF_GRACE),
                None => deadline,
            };
            let chunk = match rx.recv_timeout(wait_until.saturating_duration_since(Instant::now()))
            {
                Ok(chunk) => chunk,
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    if exit.is_some() {
                        break; // Status known; QEMU just would not power off.
                    }
                    let _ = child.kill();
                    return Err(LabError::Timeout {
                        timeout: self.config.timeout,
                        console: tail(&filter.boot_log(), 40),
                    }
                    .into());
                }
            };
            for event in filter.feed(&chunk) {
                match event {
                    Event::Output(bytes) => {
                        sink.write_all(&bytes)
                            .context("writing the command's output")?;
                        sink.flush()?;
                    }
                    Event::Init(uptime) => {
                        let wall = started.elapsed();
                        outcome.l1_init = Some(wall);
                        outcome.l1_init_uptime = uptime;
                        if progress {
                            eprintln!(
                                "tine-lab: L1 reached init in {:.1}s (L1 uptime {})",
                                wall.as_secs_f64(),
                                uptime.map_or("?".into(), |u| format!("{u:.2}s"))
                            );
                        }
                    }
                    Event::Started => {
                        let wall = started.elapsed();
                        outcome.l1_ready = Some(wall);
                        if progress {
                            eprintln!(
                                "tine-lab: kvm_amd, virtio and 9p ready after {:.1}s; running the command",
                                wall.as_secs_f64()
                            );
                        }
                    }
                    Event::SetupFailed(step) => {
                        let _ = child.kill();
                        return Err(LabError::SetupFailed {
                            step,
                            console: tail(&filter.boot_log(), 40),
                        }
                        .into());
                    }
                    Event::Exit(code) => exit = Some(code),
                }
            }
        }
        for event in filter.flush() {
            if let Event::Output(bytes) = event {
                sink.write_all(&bytes)?;
            }
        }
        sink.flush()?;
        let Some(code) = exit else {
            let status = child
                .wait()
                .map(|s| s.to_string())
                .unwrap_or_else(|e| format!("wait failed: {e}"));
            return Err(LabError::NoExitStatus {
                status,
                console: tail(&filter.boot_log(), 40),
                stderr: tail(&stderr_thread.join().unwrap_or_default(), 20),
            }
            .into());
        };
        outcome.exit_code = code;
        outcome.total = started.elapsed();
        if progress {
            eprintln!(
                "tine-lab: command exited with status {code}; total {:.1}s",
                outcome.total.as_secs_f64()
            );
        }
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tails_drop_escapes_and_keep_the_end() {
        let log = "\x1bc\x1b[?7l\x1b[2JSeaBIOS\r\n\n\nline2\nline3\n";
        assert_eq!(super::tail(log, 2), "line2\nline3");
        assert_eq!(super::tail(log, 10), "SeaBIOS\nline2\nline3");
    }
}
