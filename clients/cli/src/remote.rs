//! Commands that talk to the control plane over gRPC: `tine sandbox`, `tine snapshots`,
//! `tine executors`. Address from TINE_ADDR, else the `up.json` a local `tine up` wrote, else
//! http://127.0.0.1:7070; token from
//! TINE_TOKEN, else the file TINE_TOKEN_FILE, else `<data dir>/admin.token` (`tine up`).

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use futures::StreamExt;
use tine_proto::v1 as pb;
use tine_proto::v1::executors_client::ExecutorsClient;
use tine_proto::v1::sandboxes_client::SandboxesClient;
use tine_proto::v1::snapshots_client::SnapshotsClient;
use tine_rpc::auth::Bearer;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

type Svc = InterceptedService<Channel, Bearer>;

struct Conn {
    rt: tokio::runtime::Runtime,
    channel: Channel,
    bearer: Bearer,
}

fn status_err(s: tonic::Status) -> anyhow::Error {
    anyhow::anyhow!("{}: {}", tine_rpc::status::code_name(s.code()), s.message())
}

impl Conn {
    fn open() -> Result<Conn> {
        let mut addr = match std::env::var("TINE_ADDR") {
            Ok(a) => a,
            // A `tine up` on this machine says where it listens.
            Err(_) => crate::local::data_dir(None)
                .ok()
                .and_then(|d| std::fs::read(d.join("up.json")).ok())
                .and_then(|raw| serde_json::from_slice::<serde_json::Value>(&raw).ok())
                .and_then(|v| v["addr"].as_str().map(str::to_owned))
                .unwrap_or_else(|| "http://127.0.0.1:7070".into()),
        };
        if !addr.contains("://") {
            addr = format!("http://{addr}");
        }
        let token = match std::env::var("TINE_TOKEN") {
            Ok(t) => Some(t),
            Err(_) => {
                let file = match std::env::var_os("TINE_TOKEN_FILE") {
                    Some(f) => Some(PathBuf::from(f)),
                    None => crate::local::data_dir(None)
                        .ok()
                        .map(|d| d.join("admin.token"))
                        .filter(|p| p.exists()),
                };
                match file {
                    Some(f) => Some(
                        tine_rpc::auth::read_token_file(&f).context("reading the token file")?,
                    ),
                    None => None,
                }
            }
        };
        if token.is_some() {
            let allow = std::env::var("TINE_ALLOW_PLAINTEXT_REMOTE").is_ok_and(|v| v == "1");
            tine_rpc::tls::check_token_transport(&addr, allow)?;
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        let mut ep =
            Endpoint::from_shared(addr.clone()).with_context(|| format!("TINE_ADDR {addr:?}"))?;
        if addr.starts_with("https://") {
            let mut tls = ClientTlsConfig::new();
            if let Some(ca) = std::env::var_os("TINE_TLS_CA") {
                tls = tls.ca_certificate(Certificate::from_pem(std::fs::read(&ca)?));
            }
            ep = ep.tls_config(tls)?;
        }
        let channel = rt.block_on(ep.connect()).with_context(|| {
            format!("connecting to the control plane at {addr} (is `tine up` running?)")
        })?;
        Ok(Conn {
            rt,
            channel,
            bearer: Bearer::new(token.as_deref())?,
        })
    }

    fn sandboxes(&self) -> SandboxesClient<Svc> {
        SandboxesClient::with_interceptor(self.channel.clone(), self.bearer.clone())
    }
    fn snapshots(&self) -> SnapshotsClient<Svc> {
        SnapshotsClient::with_interceptor(self.channel.clone(), self.bearer.clone())
    }
    fn executors(&self) -> ExecutorsClient<Svc> {
        ExecutorsClient::with_interceptor(self.channel.clone(), self.bearer.clone())
    }
}

#[derive(clap::Subcommand)]
pub enum SandboxCommand {
    /// Fork N sandboxes from a snapshot; one line per child as it becomes ready.
    Spawn {
        #[arg(long)]
        tag: String,
        #[arg(short = 'n', long, default_value_t = 1)]
        count: u32,
        /// spread (balance executors) or pack (fill one first).
        #[arg(long, default_value = "spread")]
        policy: String,
        /// Only these executors (repeatable).
        #[arg(long = "executor")]
        executors: Vec<String>,
        #[arg(long, default_value_t = 0)]
        ready_timeout_ms: u32,
        /// Fail at once if the snapshot is still being written (a branch taken with
        /// --no-wait) instead of waiting for it.
        #[arg(long)]
        no_wait: bool,
        /// Internet access for these children: allow or deny (default: the executor's).
        #[arg(long, value_parser = ["allow", "deny"])]
        internet: Option<String>,
        /// Reachable even with the internet denied: CIDR[:port] (repeatable).
        #[arg(long = "allow")]
        allow: Vec<String>,
        /// Never reachable: CIDR[:port] (repeatable; wins over --allow).
        #[arg(long = "deny")]
        deny: Vec<String>,
        /// Host memory each child may hold (its VMM and the pages it wrote); the kernel kills
        /// it past that (0: the guest's RAM plus 128 MiB; at least 64).
        #[arg(long, default_value_t = 0)]
        memory_limit_mib: u64,
        /// CPU share of each child in thousandths of a core (0: unlimited; at least 10).
        #[arg(long, default_value_t = 0)]
        cpu_millis: u32,
        /// Seconds each child lives before it is killed (0: the control plane's default).
        #[arg(long, default_value_t = 0)]
        sandbox_timeout_secs: u32,
        #[arg(long)]
        json: bool,
    },
    /// Kill a sandbox SECS seconds from now instead (extend or shorten its timeout).
    SetTimeout { id: String, secs: u32 },
    /// One sandbox: its state, why it ended, its limits and what it uses now.
    Get {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// List sandboxes.
    Ls {
        #[arg(long)]
        tag: Option<String>,
        /// Include killed, failed and lost ones.
        #[arg(long)]
        all: bool,
    },
    /// Kill sandboxes.
    Kill { ids: Vec<String> },
    /// Run a command in a sandbox; exits with its exit code.
    Exec {
        id: String,
        #[arg(long)]
        timeout_ms: Option<u32>,
        #[arg(trailing_var_arg = true, required = true)]
        argv: Vec<String>,
    },
    /// Evaluate Python in a sandbox's warm interpreter.
    Eval { id: String, code: String },
    /// Expose a TCP port of the sandbox's guest on its executor host; prints host:port.
    /// Closed when the sandbox ends.
    Port { id: String, guest_port: u32 },
    /// Copy a file: `ID:/path LOCAL` (out) or `LOCAL ID:/path` (in).
    Cp { from: String, to: String },
    /// Snapshot a running sandbox under a new tag; it runs on, and children of the new tag
    /// start from this instant.
    Branch {
        id: String,
        #[arg(long)]
        tag: String,
        /// diff (the pages written since the fork, over its snapshot, written inside the
        /// pause), live (the same, written after the sandbox resumes) or full (a complete
        /// image).
        #[arg(long, default_value = "diff")]
        mode: String,
        /// Return as soon as the sandbox resumes: the snapshot is WRITING until complete
        /// (`tine snapshot get TAG` shows when it is READY); spawns from it wait for it.
        #[arg(long)]
        no_wait: bool,
        #[arg(long)]
        json: bool,
    },
}

fn branch_mode(m: &str) -> Result<pb::BranchMode> {
    Ok(match m {
        "diff" => pb::BranchMode::Diff,
        "full" => pb::BranchMode::Full,
        "live" => pb::BranchMode::Live,
        other => bail!("--mode {other:?}: use diff, full or live"),
    })
}

fn split_remote(s: &str) -> Option<(&str, &str)> {
    s.split_once(':')
        .filter(|(id, p)| !id.is_empty() && p.starts_with('/'))
}

pub fn sandbox(c: SandboxCommand) -> Result<i32> {
    let conn = Conn::open()?;
    let mut sb = conn.sandboxes();
    conn.rt.block_on(async {
        match c {
            SandboxCommand::Spawn {
                tag,
                count,
                policy,
                executors,
                ready_timeout_ms,
                no_wait,
                internet,
                allow,
                deny,
                memory_limit_mib,
                cpu_millis,
                sandbox_timeout_secs,
                json,
            } => {
                let network = (internet.is_some() || !allow.is_empty() || !deny.is_empty())
                    .then_some(pb::Network {
                        internet: match internet.as_deref() {
                            Some("allow") => pb::Internet::Allow as i32,
                            Some(_) => pb::Internet::Deny as i32,
                            None => pb::Internet::Default as i32,
                        },
                        allow,
                        deny,
                    });
                let policy = match policy.as_str() {
                    "spread" => pb::PlacementPolicy::Spread,
                    "pack" => pb::PlacementPolicy::Pack,
                    other => bail!("--policy {other:?}: spread or pack"),
                };
                let t0 = Instant::now();
                let mut stream = sb
                    .spawn(pb::SpawnRequest {
                        tag,
                        count,
                        resources: (memory_limit_mib != 0 || cpu_millis != 0).then_some(
                            pb::Resources {
                                memory_limit_mib,
                                cpu_millis,
                            },
                        ),
                        placement: Some(pb::Placement {
                            policy: policy as i32,
                            executors,
                        }),
                        ready_timeout_ms,
                        no_wait,
                        network,
                        sandbox_timeout_s: sandbox_timeout_secs,
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                let (mut ok, mut failed) = (Vec::new(), 0);
                while let Some(ev) = stream.next().await {
                    let ev = ev.map_err(status_err)?;
                    match ev.result {
                        Some(pb::spawn_event::Result::Ready(s)) => {
                            ok.push(s.ready_us);
                            if json {
                                println!(
                                    "{{\"index\":{},\"id\":{:?},\"executor\":{:?},\"ready_us\":{}}}",
                                    ev.index, s.id, s.executor, s.ready_us
                                );
                            } else {
                                println!(
                                    "{:<22} on {:<12} ready in {:>9.2} ms",
                                    s.id,
                                    s.executor,
                                    s.ready_us as f64 / 1e3
                                );
                            }
                        }
                        Some(pb::spawn_event::Result::Failed(f)) => {
                            failed += 1;
                            if json {
                                println!(
                                    "{{\"index\":{},\"id\":{:?},\"code\":{:?},\"error\":{:?}}}",
                                    ev.index, f.sandbox_id, f.code, f.message
                                );
                            } else {
                                println!("{:<22} FAILED ({}): {}", f.sandbox_id, f.code, f.message);
                            }
                        }
                        None => {}
                    }
                }
                ok.sort_unstable();
                if !json && !ok.is_empty() {
                    let p = |q: f64| ok[((ok.len() - 1) as f64 * q).round() as usize] as f64 / 1e3;
                    println!(
                        "{} ready, {failed} failed in {:.1} ms (p50 {:.1} ms, p90 {:.1} ms, max {:.1} ms)",
                        ok.len(),
                        t0.elapsed().as_secs_f64() * 1e3,
                        p(0.5),
                        p(0.9),
                        p(1.0)
                    );
                }
                Ok(if failed > 0 { 1 } else { 0 })
            }
            SandboxCommand::SetTimeout { id, secs } => {
                let s = sb
                    .set_timeout(pb::SetTimeoutRequest {
                        sandbox_id: id,
                        timeout_s: secs,
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                println!("{} now expires in {secs} s", s.id);
                Ok(0)
            }
            SandboxCommand::Get { id, json } => {
                let s = sb
                    .get_sandbox(pb::GetSandboxRequest { id })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                print_sandbox(&s, json);
                Ok(0)
            }
            SandboxCommand::Ls { tag, all } => {
                let tag = tag.unwrap_or_default();
                let sandboxes = all_pages(|page_token| {
                    let (mut sb, tag) = (sb.clone(), tag.clone());
                    async move {
                        let r = sb
                            .list_sandboxes(pb::ListSandboxesRequest {
                                tag,
                                all,
                                page_size: 0,
                                page_token,
                            })
                            .await
                            .map_err(status_err)?
                            .into_inner();
                        Ok((r.sandboxes, r.next_page_token))
                    }
                })
                .await?;
                println!("{:<22} {:<10} {:<16} {:<12} {:>10}", "ID", "STATE", "SNAPSHOT", "EXECUTOR", "READY ms");
                for s in sandboxes {
                    let state = sandbox_state(&s);
                    println!(
                        "{:<22} {:<10} {:<16} {:<12} {:>10.2}",
                        s.id,
                        state,
                        s.tag,
                        s.executor,
                        s.ready_us as f64 / 1e3
                    );
                }
                Ok(0)
            }
            SandboxCommand::Branch {
                id,
                tag,
                mode,
                no_wait,
                json,
            } => {
                let t0 = Instant::now();
                let s = sb
                    .branch(pb::BranchRequest {
                        sandbox_id: id.clone(),
                        tag,
                        mode: branch_mode(&mode)? as i32,
                        no_wait,
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                let b = s.branch.unwrap_or_default();
                if json {
                    println!(
                        "{}",
                        serde_json::json!({
                            "tag": s.tag, "parent": s.parent_tag, "source_sandbox": s.source_sandbox,
                            "executors": s.executors, "mode": mode, "state": state_name(s.state),
                            "pause_us": b.pause_us, "pages_written": b.pages_written,
                            "took_us": b.took_us, "rebase_pause_us": b.rebase_pause_us,
                            "client_ms": t0.elapsed().as_secs_f64() * 1e3,
                        })
                    );
                } else if no_wait {
                    print_snapshot(&s, "");
                    println!(
                        "[tine] branched {id} ({mode}): paused {:.2} ms, resumed; the snapshot is {} ({:.1} ms in all)",
                        b.pause_us as f64 / 1e3,
                        state_name(s.state),
                        t0.elapsed().as_secs_f64() * 1e3
                    );
                } else {
                    print_snapshot(&s, "");
                    println!(
                        "[tine] branched {id} ({mode}): paused {:.2} ms (then {:.2} ms to rebase it onto the branch), {} pages written since its fork or last branch ({:.1} MiB), {:.1} ms on the executor, {:.1} ms in all",
                        b.pause_us as f64 / 1e3,
                        b.rebase_pause_us as f64 / 1e3,
                        b.pages_written,
                        (b.pages_written * 4096) as f64 / (1 << 20) as f64,
                        b.took_us as f64 / 1e3,
                        t0.elapsed().as_secs_f64() * 1e3
                    );
                }
                Ok(0)
            }
            SandboxCommand::Kill { ids } => {
                if ids.is_empty() {
                    bail!("name the sandboxes to kill (see `tine sandbox ls`)");
                }
                for id in ids {
                    sb.kill_sandbox(pb::KillSandboxRequest { id: id.clone() })
                        .await
                        .map_err(status_err)?;
                    eprintln!("[tine] killed {id}");
                }
                Ok(0)
            }
            SandboxCommand::Exec { id, timeout_ms, argv } => {
                let mut stream = sb
                    .exec(pb::ExecRequest {
                        sandbox_id: id,
                        argv,
                        env: Default::default(),
                        cwd: String::new(),
                        stdin: Vec::new(),
                        timeout_ms: timeout_ms.unwrap_or(0),
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                while let Some(ev) = stream.next().await {
                    match ev.map_err(status_err)?.event {
                        Some(pb::exec_event::Event::Stdout(d)) => std::io::stdout().write_all(&d)?,
                        Some(pb::exec_event::Event::Stderr(d)) => std::io::stderr().write_all(&d)?,
                        Some(pb::exec_event::Event::Exit(e)) => {
                            std::io::stdout().flush()?;
                            if e.timed_out {
                                eprintln!("[tine] command timed out and was killed");
                            }
                            return Ok(match e.how {
                                Some(pb::exit_status::How::Code(c)) => c,
                                Some(pb::exit_status::How::Signal(s)) => 128 + s,
                                None => 1,
                            });
                        }
                        None => {}
                    }
                }
                bail!("the exec stream ended without an exit status")
            }
            SandboxCommand::Port { id, guest_port } => {
                let r = sb
                    .expose_port(pb::ExposePortRequest {
                        sandbox_id: id,
                        guest_port,
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                println!("{}", r.address);
                Ok(0)
            }
            SandboxCommand::Eval { id, code } => {
                let r = sb
                    .eval(pb::EvalRequest {
                        sandbox_id: id,
                        code,
                        timeout_ms: 0,
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                print!("{}", r.stdout);
                eprint!("{}", r.stderr);
                if let Some(why) = &r.restarted {
                    eprintln!("[tine] the sandbox's interpreter was restarted first: {why}");
                }
                if let Some(err) = r.error {
                    eprintln!("{err}");
                    return Ok(1);
                }
                if let Some(v) = r.value {
                    println!("{v}");
                }
                Ok(0)
            }
            SandboxCommand::Cp { from, to } => match (split_remote(&from), split_remote(&to)) {
                (Some((id, path)), None) => {
                    let mut stream = sb
                        .read_file(pb::ReadFileRequest {
                            sandbox_id: id.into(),
                            path: path.into(),
                        })
                        .await
                        .map_err(status_err)?
                        .into_inner();
                    let tmp = PathBuf::from(format!("{to}.tine-partial"));
                    let mut f = std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
                    let mut n = 0u64;
                    while let Some(c) = stream.next().await {
                        let c = c.map_err(status_err)?;
                        f.write_all(&c.data)?;
                        n += c.data.len() as u64;
                    }
                    f.sync_all()?;
                    std::fs::rename(&tmp, &to)?;
                    eprintln!("[tine] {n} bytes -> {to}");
                    Ok(0)
                }
                (None, Some((id, path))) => {
                    let data = std::fs::read(&from).with_context(|| format!("reading {from}"))?;
                    let mut msgs = vec![pb::WriteFileRequest {
                        part: Some(pb::write_file_request::Part::Header(pb::WriteFileHeader {
                            sandbox_id: id.into(),
                            path: path.into(),
                            mode: 0o644,
                        })),
                    }];
                    for chunk in data.chunks(1 << 20) {
                        msgs.push(pb::WriteFileRequest {
                            part: Some(pb::write_file_request::Part::Data(chunk.to_vec())),
                        });
                    }
                    let r = sb
                        .write_file(futures::stream::iter(msgs))
                        .await
                        .map_err(status_err)?
                        .into_inner();
                    eprintln!("[tine] {} bytes -> {id}:{path}", r.size);
                    Ok(0)
                }
                _ => bail!("give exactly one side as SANDBOX_ID:/absolute/path"),
            },
        }
    })
}

#[derive(clap::Subcommand)]
pub enum SnapshotsCommand {
    /// Boot an image on an executor, warm it, snapshot it.
    Create {
        #[arg(long)]
        tag: String,
        #[arg(long)]
        image: String,
        #[arg(long = "eval", value_name = "CODE")]
        evals: Vec<String>,
        #[arg(long, default_value_t = 1)]
        vcpus: u32,
        #[arg(long, default_value_t = 0)]
        mem_mib: u64,
        #[arg(long, default_value = "")]
        executor: String,
    },
    Ls,
    /// One snapshot with its ancestors and descendants.
    Get {
        tag: String,
    },
    /// Delete a snapshot (refused while it has descendants, unless --cascade).
    Rm {
        tag: String,
        #[arg(long)]
        cascade: bool,
    },
}

fn state_name(state: i32) -> &'static str {
    match pb::SnapshotState::try_from(state) {
        Ok(pb::SnapshotState::Writing) => "WRITING",
        Ok(pb::SnapshotState::Failed) => "FAILED",
        _ => "READY",
    }
}

fn print_snapshot(s: &pb::Snapshot, indent: &str) {
    let state = match pb::SnapshotState::try_from(s.state) {
        Ok(pb::SnapshotState::Writing) => " WRITING".to_string(),
        Ok(pb::SnapshotState::Failed) => format!(" FAILED: {}", s.error),
        _ => String::new(),
    };
    println!(
        "{indent}{:<20} parent {:<16} image {:<16} {} vCPU {:>6} MiB on [{}]{state}",
        s.tag,
        if s.parent_tag.is_empty() {
            "-"
        } else {
            &s.parent_tag
        },
        s.image,
        s.vcpus,
        s.mem_mib,
        s.executors.join(",")
    );
}

/// Where a snapshot is in the cluster's store, and what it costs there.
fn print_layers(s: &pb::Snapshot) {
    let Some(l) = &s.layers else {
        println!("  layers     none (made without a store: only its executors can spawn it)");
        return;
    };
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("  head       {}", l.head_digest);
    if !l.parent_digest.is_empty() {
        println!("  parent     {}", l.parent_digest);
    }
    println!(
        "  chain      {} layer(s): {}",
        l.chain.len(),
        l.chain.join(" <- ")
    );
    println!(
        "  size       memory {:.1} MiB, stored pages {:.1} MiB, compressed {:.1} MiB ({:.1}x smaller than memory)",
        mib(l.memory_bytes),
        mib(l.stored_bytes),
        mib(l.compressed_bytes),
        l.memory_bytes as f64 / l.compressed_bytes.max(1) as f64
    );
}

pub fn snapshots(c: SnapshotsCommand) -> Result<i32> {
    let conn = Conn::open()?;
    let mut sn = conn.snapshots();
    conn.rt.block_on(async {
        match c {
            SnapshotsCommand::Create {
                tag,
                image,
                evals,
                vcpus,
                mem_mib,
                executor,
            } => {
                let t0 = Instant::now();
                let s = sn
                    .create_snapshot(pb::CreateSnapshotRequest {
                        tag,
                        image,
                        vcpus,
                        mem_mib,
                        warmup_eval: evals,
                        executor,
                    })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                print_snapshot(&s, "");
                eprintln!("[tine] created in {:.1} s", t0.elapsed().as_secs_f64());
            }
            SnapshotsCommand::Ls => {
                let snapshots = all_pages(|page_token| {
                    let mut sn = sn.clone();
                    async move {
                        let r = sn
                            .list_snapshots(pb::ListSnapshotsRequest {
                                page_size: 0,
                                page_token,
                            })
                            .await
                            .map_err(status_err)?
                            .into_inner();
                        Ok((r.snapshots, r.next_page_token))
                    }
                })
                .await?;
                for s in &snapshots {
                    print_snapshot(s, "");
                }
            }
            SnapshotsCommand::Get { tag } => {
                let r = sn
                    .get_snapshot(pb::GetSnapshotRequest { tag })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                if let Some(s) = &r.snapshot {
                    print_snapshot(s, "");
                    print_layers(s);
                }
                for a in &r.ancestors {
                    print_snapshot(a, "  ancestor   ");
                }
                for d in &r.descendants {
                    print_snapshot(d, "  descendant ");
                }
            }
            SnapshotsCommand::Rm { tag, cascade } => {
                let r = sn
                    .delete_snapshot(pb::DeleteSnapshotRequest { tag, cascade })
                    .await
                    .map_err(status_err)?
                    .into_inner();
                eprintln!("[tine] deleted {}", r.deleted.join(", "));
            }
        }
        Ok(0)
    })
}

#[derive(clap::Subcommand)]
pub enum ExecutorsCommand {
    Ls,
    /// Place no new sandboxes on an executor.
    Drain {
        id: String,
    },
}

pub fn executors(c: ExecutorsCommand) -> Result<i32> {
    let conn = Conn::open()?;
    let mut ex = conn.executors();
    conn.rt.block_on(async {
        let list = match c {
            ExecutorsCommand::Ls => {
                all_pages(|page_token| {
                    let mut ex = ex.clone();
                    async move {
                        let r = ex
                            .list_executors(pb::ListExecutorsRequest {
                                page_size: 0,
                                page_token,
                            })
                            .await
                            .map_err(status_err)?
                            .into_inner();
                        Ok((r.executors, r.next_page_token))
                    }
                })
                .await?
            }
            ExecutorsCommand::Drain { id } => vec![ex
                .drain_executor(pb::DrainExecutorRequest { id })
                .await
                .map_err(status_err)?
                .into_inner()],
        };
        println!(
            "{:<14} {:<9} {:<28} {:>9} {:>12} {:>7}  SNAPSHOTS",
            "ID", "STATE", "ADDR", "RUNNING", "MEM FREE MiB", "SEEN"
        );
        let now_ms = tine_control_plane::now_ms();
        for e in list {
            let cap = e.capacity.unwrap_or_default();
            let state = pb::ExecutorState::try_from(e.state)
                .map(|s| {
                    s.as_str_name()
                        .trim_start_matches("EXECUTOR_STATE_")
                        .to_lowercase()
                })
                .unwrap_or_default();
            // Seconds since its last heartbeat: what "up" and "down" are decided on.
            let seen = match e.last_heartbeat_unix_ms {
                0 => "-".to_string(),
                t => format!("{}s", (now_ms - t).max(0) / 1000),
            };
            println!(
                "{:<14} {:<9} {:<28} {:>4}/{:<4} {:>12} {:>7}  {}",
                e.id,
                state,
                e.addr,
                cap.running_sandboxes,
                cap.max_sandboxes,
                cap.mem_available_mib,
                seen,
                e.cached_tags.join(",")
            );
        }
        Ok(0)
    })
}

/// A sandbox's state as the CLI prints it: "ready", "failed", ...
fn sandbox_state(s: &pb::Sandbox) -> String {
    pb::SandboxState::try_from(s.state)
        .map(|st| {
            st.as_str_name()
                .trim_start_matches("SANDBOX_STATE_")
                .to_lowercase()
        })
        .unwrap_or_default()
}

/// `tine sandbox get`: one field per line, or one JSON object.
fn print_sandbox(s: &pb::Sandbox, json: bool) {
    let state = sandbox_state(s);
    let res = s.resources.unwrap_or_default();
    let u = s.usage.as_ref();
    if json {
        let v = serde_json::json!({
            "id": s.id, "tag": s.tag, "executor": s.executor, "state": state,
            "created_unix_ms": s.created_unix_ms, "ready_us": s.ready_us, "error": s.error,
            "memory_limit_mib": res.memory_limit_mib, "cpu_millis": res.cpu_millis,
            "expires_unix_ms": s.expires_unix_ms,
            "usage": u.map(|u| serde_json::json!({
                "memory_current_bytes": u.memory_current_bytes,
                "memory_peak_bytes": u.memory_peak_bytes,
                "memory_max_bytes": u.memory_max_bytes,
                "cpu_usage_us": u.cpu_usage_us,
                "cpu_throttled_periods": u.cpu_throttled_periods,
            })),
        });
        println!("{v}");
        return;
    }
    let or_default = |v: u64, unit: &str, default: &str| {
        if v == 0 {
            default.to_string()
        } else {
            format!("{v} {unit}")
        }
    };
    println!("id:             {}", s.id);
    println!("state:          {state}");
    println!("snapshot:       {}", s.tag);
    println!("executor:       {}", s.executor);
    println!("ready in:       {:.2} ms", s.ready_us as f64 / 1e3);
    if !s.error.is_empty() {
        println!("ended:          {}", s.error);
    } else if s.expires_unix_ms > 0 {
        let now = tine_control_plane::now_ms();
        println!(
            "expires in:     {:.0} s",
            (s.expires_unix_ms - now).max(0) as f64 / 1e3
        );
    }
    println!(
        "memory limit:   {}",
        or_default(res.memory_limit_mib, "MiB", "default (guest RAM + 128 MiB)")
    );
    println!(
        "cpu share:      {}",
        or_default(u64::from(res.cpu_millis), "millis", "unlimited")
    );
    if let Some(u) = u {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        println!("memory.current: {:.1} MiB", mib(u.memory_current_bytes));
        if u.memory_peak_bytes > 0 {
            println!("memory.peak:    {:.1} MiB", mib(u.memory_peak_bytes));
        }
        if u.memory_max_bytes > 0 {
            println!("memory.max:     {:.1} MiB", mib(u.memory_max_bytes));
        }
        println!("cpu time:       {:.3} s", u.cpu_usage_us as f64 / 1e6);
        println!("cpu throttled:  {} periods", u.cpu_throttled_periods);
    }
}

/// Every entry of a paged List call: `page(token)` answers one page and the next page's
/// token ("" after the last).
async fn all_pages<T, F, Fut>(mut page: F) -> Result<Vec<T>>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = Result<(Vec<T>, String)>>,
{
    let (mut out, mut token) = (Vec::new(), String::new());
    loop {
        let (entries, next) = page(token).await?;
        out.extend(entries);
        if next.is_empty() {
            return Ok(out);
        }
        token = next;
    }
}
