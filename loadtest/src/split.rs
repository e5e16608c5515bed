//! The control plane in a process of its own, optionally pinned to CPUs apart from the load.
//!
//! In one process the load's clients, the null executors and the control plane share one
//! tokio runtime, so every latency also carries the load's own scheduling. With `--split`
//! the load process re-runs this binary as `--serve-control-plane`: the child holds only the
//! control plane (SQLite, audit log, auth); the clients and the null executors stay in the
//! parent, so the executor hop crosses processes as it does in a deployment. The child
//! reports its address and token as one JSON line on stdout and serves until its stdin closes,
//! then writes its spawn phases and lock counters as a last JSON line. A `mark` line on its
//! stdin makes it count from then on only (answered with `{"marked":true}`), so spawns made
//! to set the load up are left out of its report.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// A set of CPUs, from a list such as `0`, `0,2` or `1-3`; each below `CPU_SETSIZE`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList(Vec<usize>);

impl CpuList {
    pub fn cpus(&self) -> &[usize] {
        &self.0
    }
}

impl std::str::FromStr for CpuList {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let mut cpus = Vec::new();
        for part in s.split(',') {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let parse = |x: &str| {
                x.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("bad CPU {x:?} in {s:?} (want e.g. 0, 0,2 or 1-3)"))
            };
            let (a, b) = (parse(a)?, parse(b)?);
            if a > b || b >= libc::CPU_SETSIZE as usize {
                return Err(format!(
                    "bad CPU range {part:?} in {s:?} (want low-high, low <= high < {})",
                    libc::CPU_SETSIZE
                ));
            }
            cpus.extend(a..=b);
        }
        cpus.sort_unstable();
        cpus.dedup();
        Ok(CpuList(cpus))
    }
}

impl std::fmt::Display for CpuList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s: Vec<String> = self.0.iter().map(|c| c.to_string()).collect();
        f.write_str(&s.join(","))
    }
}

/// Pin the calling thread (and the threads it starts later) to `cpus`.
pub fn pin(cpus: &CpuList) -> Result<()> {
    // SAFETY: cpu_set_t is plain data; every CPU is below CPU_SETSIZE (checked when parsed,
    // and the list is built nowhere else); sched_setaffinity only reads the set.
    let r = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in &cpus.0 {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error()).with_context(|| {
            format!(
                "pinning to CPUs {cpus} (allowed here: {})",
                allowed().map_or_else(|e| e.to_string(), |a| a.to_string())
            )
        });
    }
    Ok(())
}

/// The CPUs this thread may run on.
pub fn allowed() -> Result<CpuList> {
    // SAFETY: sched_getaffinity writes at most the size we pass into the set; CPU_ISSET
    // reads inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Err(std::io::Error::last_os_error()).context("reading this process's CPUs");
        }
        Ok(CpuList(
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect(),
        ))
    }
}

/// What the serving child reports once it listens.
pub struct Serving {
    pub addr: String,
    pub token: String,
}

pub struct ControlPlaneChild {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

fn read_json_line(r: &mut impl BufRead, what: &str) -> Result<Value> {
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        bail!("the control-plane process exited before reporting {what} (see its stderr above)");
    }
    serde_json::from_str(&line).with_context(|| format!("control-plane process: {what}: {line:?}"))
}

/// Ended sandboxes recorded in the control plane's database before the run (`--history`,
/// `--history-days`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct History {
    pub count: u64,
    /// They ended evenly over this many days up to now.
    pub days: u32,
}

impl History {
    /// The arguments that ask a control-plane process for the same.
    fn args(&self) -> [String; 4] {
        [
            "--history".into(),
            self.count.to_string(),
            "--history-days".into(),
            self.days.to_string(),
        ]
    }
}

impl ControlPlaneChild {
    /// Start this binary as the control plane behind `null_executors`, pinned to `cpus`, with
    /// `history` recorded.
    pub fn start(
        null_executors: &[String],
        cpus: Option<&CpuList>,
        history: History,
    ) -> Result<(ControlPlaneChild, Serving)> {
        let exe = std::env::current_exe().context("finding tine-loadtest's own binary")?;
        let mut cmd = Command::new(exe);
        cmd.arg("--serve-control-plane")
            .args(
                null_executors
                    .iter()
                    .flat_map(|a| ["--null-executor-addr", a.as_str()]),
            )
            .args(history.args())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(cpus) = cpus {
            cmd.args(["--cp-cpus", &cpus.to_string()]);
        }
        let mut child = cmd.spawn().context("starting the control-plane process")?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        // Made before anything can fail, so Drop stops a child that fails its announcement.
        let mut cp = ControlPlaneChild {
            child,
            stdin,
            stdout,
        };
        let hello = read_json_line(&mut cp.stdout, "its address")?;
        let field = |k: &str| {
            hello[k]
                .as_str()
                .map(str::to_string)
                .with_context(|| format!("control-plane process: no {k} in {hello}"))
        };
        let serving = Serving {
            addr: field("addr")?,
            token: field("token")?,
        };
        Ok((cp, serving))
    }

    /// Have the child report only what comes after this (see the module's note).
    pub fn mark(&mut self) -> Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .context("the control-plane process was told to stop")?;
        writeln!(stdin, "{MARK}").context("writing to the control-plane process")?;
        stdin
            .flush()
            .context("writing to the control-plane process")?;
        let answer = read_json_line(&mut self.stdout, "its mark")?;
        if answer["marked"] != Value::Bool(true) {
            bail!("control-plane process: {answer} where its mark was due");
        }
        Ok(())
    }

    /// Tell the child to stop and collect its report (spawn phases, lock counters).
    pub fn finish(mut self) -> Result<Value> {
        drop(self.stdin.take());
        let report = read_json_line(&mut self.stdout, "its spawn phases")?;
        let status = self.child.wait()?;
        if !status.success() {
            bail!("the control-plane process exited with {status}");
        }
        Ok(report)
    }
}

impl Drop for ControlPlaneChild {
    /// On an error path: close its stdin so it shuts down and removes its temporary
    /// directory; kill it only if it has not within a few seconds.
    fn drop(&mut self) {
        if self.stdin.take().is_none() {
            return;
        }
        for _ in 0..50 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// In the child: one JSON line to the parent (its address first, its report last).
pub fn tell_parent(v: &Value) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{v}").context("writing to the load process")?;
    out.flush().context("writing to the load process")?;
    Ok(())
}

/// The line that asks the child to mark (see the module's note).
pub const MARK: &str = "mark";

/// In the child: the parent's lines on our stdin, as they come; the channel closes when the
/// parent closes our stdin (or it cannot be read).
pub fn parent_lines() -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            if tx.send(line.trim().to_string()).is_err() {
                break;
            }
        }
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!("0".parse::<CpuList>().unwrap(), CpuList(vec![0]));
        assert_eq!(
            "3,1-2,1".parse::<CpuList>().unwrap(),
            CpuList(vec![1, 2, 3])
        );
        assert!("2-1".parse::<CpuList>().is_err());
        assert!("x".parse::<CpuList>().is_err());
        assert!("99999".parse::<CpuList>().is_err());
        assert_eq!(CpuList(vec![0, 2]).to_string(), "0,2");
        let here = allowed().unwrap();
        assert!(!here.cpus().is_empty());
        assert_eq!(here.to_string().parse::<CpuList>().unwrap(), here);
    }
}
