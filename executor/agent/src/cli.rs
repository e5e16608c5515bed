//! `tine exec|eval|cp|ping` against a VM's agent. The `tine` binary embeds
//! [`AgentCli`] (or [`AgentCommand`] + [`AgentTarget`]) and calls [`run`],
//! exiting with the returned code.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};

use crate::client::{AgentClient, Connector, ExecOptions, Readiness, AGENT_PORT};

/// Exit code for a command killed at its timeout (as timeout(1) uses).
pub const EXIT_TIMED_OUT: i32 = 124;

#[derive(Debug, clap::Parser)]
#[command(about = "Talk to a Tine VM's guest agent")]
pub struct AgentCli {
    #[command(flatten)]
    pub target: AgentTarget,
    #[command(subcommand)]
    pub command: AgentCommand,
}

#[derive(Debug, Clone, clap::Args)]
pub struct AgentTarget {
    /// The VM's vsock Unix socket (Firecracker-style CONNECT handshake).
    #[arg(long, global = true, env = "TINE_VSOCK", value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Talk to an agent listening directly on this Unix socket (tests).
    #[arg(long, global = true, value_name = "PATH", conflicts_with = "socket")]
    pub agent_unix: Option<PathBuf>,
}

impl AgentTarget {
    pub fn client(&self) -> anyhow::Result<AgentClient> {
        let connector = match (&self.agent_unix, &self.socket) {
            (Some(p), _) => Connector::Unix(p.clone()),
            (None, Some(p)) => Connector::Vsock {
                uds: p.clone(),
                port: AGENT_PORT,
            },
            (None, None) => bail!("no agent given: pass --socket PATH (or set TINE_VSOCK)"),
        };
        Ok(AgentClient::new(connector))
    }
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum AgentCommand {
    /// Run a command in the VM; exits with its exit code.
    Exec {
        /// Kill the command (and its process group) after this many seconds.
        #[arg(long, value_name = "S")]
        timeout: Option<f64>,
        /// Extra environment variable (repeatable).
        #[arg(long = "env", value_name = "K=V")]
        env: Vec<String>,
        /// Working directory inside the VM.
        #[arg(long, value_name = "D")]
        cwd: Option<String>,
        #[arg(last = true, required = true, value_name = "ARGV")]
        argv: Vec<String>,
    },
    /// Evaluate Python in the VM's warm interpreter; prints the repr.
    Eval {
        code: String,
        /// Kill the interpreter if the eval runs longer (state is lost).
        #[arg(long, value_name = "S")]
        timeout: Option<f64>,
    },
    /// Copy a file; prefix the guest side with `vm:` (either direction).
    Cp { src: String, dst: String },
    /// Show the agent's version, uptime and readiness.
    Ping {
        /// Wait up to this many seconds for the agent to become ready.
        #[arg(long, value_name = "S")]
        wait: Option<f64>,
    },
}

/// Runs the command with our stdout/stderr; returns the process exit code.
pub fn run(cli: &AgentCli) -> anyhow::Result<i32> {
    let (mut out, mut err) = (std::io::stdout().lock(), std::io::stderr().lock());
    run_with(&cli.target, &cli.command, &mut out, &mut err)
}

pub fn run_with(
    target: &AgentTarget,
    command: &AgentCommand,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> anyhow::Result<i32> {
    let client = target.client()?;
    match command {
        AgentCommand::Exec {
            timeout,
            env,
            cwd,
            argv,
        } => {
            let env = env
                .iter()
                .map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_owned(), v.to_owned()))
                        .with_context(|| format!("--env {kv:?}: expected K=V"))
                })
                .collect::<anyhow::Result<_>>()?;
            let opts = ExecOptions {
                env,
                cwd: cwd.clone(),
                stdin: Vec::new(),
                timeout: timeout.map(seconds).transpose()?,
            };
            // Output write errors (closed pipe) must not abort the remote command.
            let st = client.exec(
                argv,
                &opts,
                |d| {
                    let _ = out.write_all(d).and_then(|_| out.flush());
                },
                |d| {
                    let _ = err.write_all(d).and_then(|_| err.flush());
                },
            )?;
            if st.timed_out {
                writeln!(
                    err,
                    "tine: `{}` timed out after {}s and was killed",
                    argv.join(" "),
                    timeout.unwrap_or_default()
                )?;
                return Ok(EXIT_TIMED_OUT);
            }
            Ok(match (st.code, st.signal) {
                (Some(c), _) => c,
                (None, Some(s)) => 128 + s,
                (None, None) => 1,
            })
        }
        AgentCommand::Eval { code, timeout } => {
            let r = client.eval_with_timeout(code, timeout.map(seconds).transpose()?)?;
            if let Some(note) = &r.restarted {
                writeln!(err, "tine: note: {note}")?;
            }
            out.write_all(r.stdout.as_bytes())?;
            err.write_all(r.stderr.as_bytes())?;
            if let Some(tb) = &r.error {
                err.write_all(tb.as_bytes())?;
                return Ok(1);
            }
            if let Some(v) = &r.value {
                writeln!(out, "{v}")?;
            }
            Ok(0)
        }
        AgentCommand::Cp { src, dst } => {
            match (src.strip_prefix("vm:"), dst.strip_prefix("vm:")) {
                (None, Some(guest)) => upload(&client, Path::new(src), guest)?,
                (Some(guest), None) => download(&client, guest, Path::new(dst))?,
                _ => bail!("cp: exactly one of SRC and DST must be a vm:/path"),
            }
            Ok(0)
        }
        AgentCommand::Ping { wait } => {
            let p = match wait {
                Some(s) => client.wait_ready(seconds(*s)?)?,
                None => client.ping()?,
            };
            let state = match &p.readiness {
                Readiness::Ready => "ready".to_owned(),
                Readiness::Warming => format!("warming (running `{}`)", p.warmup_command),
                Readiness::Failed(e) => format!("warm-up failed: {e}"),
            };
            writeln!(
                out,
                "tine-agent {} up {:.1}s: {state}",
                p.agent_version,
                p.uptime.as_secs_f64()
            )?;
            Ok(if p.readiness == Readiness::Ready {
                0
            } else {
                1
            })
        }
    }
}

fn seconds(s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s).with_context(|| format!("invalid number of seconds: {s}"))
}

fn upload(client: &AgentClient, src: &Path, guest: &str) -> anyhow::Result<()> {
    let file = File::open(src).with_context(|| format!("opening {}", src.display()))?;
    let mode = file.metadata()?.permissions().mode() & 0o7777;
    // `vm:/dir/` means "into that directory, same name".
    let guest = if guest.ends_with('/') {
        let name = src
            .file_name()
            .with_context(|| format!("{} has no file name", src.display()))?;
        format!("{guest}{}", name.to_string_lossy())
    } else {
        guest.to_owned()
    };
    client
        .write_file(&guest, mode, file)
        .with_context(|| format!("copying {} to vm:{guest}", src.display()))?;
    Ok(())
}

fn download(client: &AgentClient, guest: &str, dst: &Path) -> anyhow::Result<()> {
    let dst = if dst.is_dir() {
        let name = guest.rsplit('/').next().filter(|n| !n.is_empty());
        dst.join(name.with_context(|| format!("vm:{guest} has no file name"))?)
    } else {
        dst.to_owned()
    };
    let mut file = File::create(&dst).with_context(|| format!("creating {}", dst.display()))?;
    match client.read_file(guest, &mut file) {
        Ok(info) => {
            file.set_permissions(std::fs::Permissions::from_mode(info.mode))?;
            Ok(())
        }
        Err(e) => {
            drop(file);
            let _ = std::fs::remove_file(&dst);
            Err(e).with_context(|| format!("copying vm:{guest} to {}", dst.display()))
        }
    }
}
