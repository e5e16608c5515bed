//! `tine snapshot`, `tine fork`, `tine ls`, `tine kill`: warm a parent once, then fork children
//! from its snapshot. Each child is its own VMM process restoring the snapshot with its guest
//! RAM mapped copy-on-write; "spawned" means its guest agent answered a ping.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tine_executor::parent::{create_snapshot, ParentSpec};
use tine_executor::ready::make_ready;
use tine_vmm::host::KvmFlavor;
use tine_vmm::vm::RestoreOptions;
use tine_vmm::Vm;

use crate::vms::{self, VmMeta};
use tine_executor::console::open_console;

/// Most children one `tine fork` may ask for.
pub const MAX_CHILDREN: usize = 1000;

fn refuse_pvm(allow: bool) -> Result<()> {
    if KvmFlavor::detect() == KvmFlavor::Pvm && !allow {
        bail!("this host's /dev/kvm is PVM: Linux guests cannot run here; use `tine lab -- tine ...` (or --allow-pvm)");
    }
    Ok(())
}

#[derive(clap::Args)]
pub struct SnapshotArgs {
    /// Guest image to boot (name, id or directory from `tine image build`).
    #[arg(long)]
    image: String,
    /// Name for the snapshot (letters, digits, `.`, `_`, `-`).
    #[arg(long)]
    tag: String,
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Guest memory (default: the image's recommendation).
    #[arg(long)]
    mem_mib: Option<u64>,
    /// Python to run in the warm interpreter before the snapshot (repeatable), e.g. `x = 42`.
    #[arg(long = "eval", value_name = "CODE")]
    evals: Vec<String>,
    /// Replace an existing snapshot with this tag.
    #[arg(long)]
    force: bool,
    /// How long to wait for the agent's warm-up.
    #[arg(long, default_value_t = 900)]
    ready_timeout_secs: u64,
    #[arg(long)]
    allow_pvm: bool,
}

pub fn snapshot(a: SnapshotArgs) -> Result<i32> {
    refuse_pvm(a.allow_pvm)?;
    let made = create_snapshot(&ParentSpec {
        image: a.image,
        tag: a.tag.clone(),
        vcpus: a.vcpus,
        mem_mib: a.mem_mib,
        evals: a.evals,
        ready_timeout: Duration::from_secs(a.ready_timeout_secs),
        replace: a.force,
    })?;
    eprintln!(
        "[tine] snapshot {}: {} vCPU, {} MiB; parent ready after {:.2} s, snapshot written in {:.1} ms -> {}",
        a.tag,
        made.header.vcpus,
        made.header.mem_size >> 20,
        made.ready_after.as_secs_f64(),
        made.written_in.as_secs_f64() * 1000.0,
        made.dir.display()
    );
    Ok(0)
}

/// One child as `tine fork` saw it.
#[derive(Clone, Debug)]
pub struct ChildReport {
    pub id: String,
    pub pid: u32,
    /// From just before spawning its process to its agent answering (and clock/RNG fixed).
    pub ready: Result<Duration, String>,
}

/// The body of a child process: restore the snapshot, tell the parent (one byte on
/// `started`) that the guest runs and its socket exists, and run the VM until it stops.
fn child_main(snapshot: &Path, dir: &Path, started: std::fs::File) -> Result<i32> {
    let vm = Vm::restore(
        snapshot,
        RestoreOptions {
            console: open_console(Some(&dir.join("console.log")))?,
            vsock_uds: Some(dir.join("vsock.sock")),
        },
    )?;
    let running = vm.start()?;
    use std::io::Write;
    let _ = (&started).write_all(b"1");
    drop(started);
    let exit = running.wait()?;
    Ok(exit.exit_code())
}

/// Start one child VMM process with fork(2): no exec and no start-up of a new binary on the
/// critical path. Must be called while this process is single-threaded (the child only
/// inherits the calling thread, so no lock can be left held by another).
fn spawn_child(snapshot: &Path, tag: &str) -> Result<(PathBuf, VmMeta, std::fs::File)> {
    let id = vms::new_id(tag);
    let dir = vms::vms_dir()?.join(&id);
    std::fs::create_dir_all(&dir)?;
    let log = std::fs::File::create(dir.join("vmm.log"))?;
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    let mut fds = [0i32; 2];
    // SAFETY: pipe2 fills two fds; both are owned below.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error()).context("pipe");
    }
    use std::os::fd::FromRawFd;
    // SAFETY: fresh fds from pipe2, each wrapped exactly once.
    let (read_end, write_end) = unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    };
    // SAFETY: plain fork(2); see the single-threaded requirement above.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error()).context("fork");
    }
    if pid == 0 {
        // Child: own session, output to its log, never return into the parent's code.
        use std::os::fd::AsRawFd;
        // SAFETY: standard descriptor and session set-up in a fresh single-threaded child.
        unsafe {
            libc::setsid();
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
            libc::dup2(null, 0);
            libc::dup2(log.as_raw_fd(), 1);
            libc::dup2(log.as_raw_fd(), 2);
        }
        drop(read_end);
        let code = match child_main(snapshot, &dir, write_end) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("tine: child {id}: {e:#}");
                1
            }
        };
        // SAFETY: leave without running the parent's exit handlers or flushing its buffers.
        unsafe { libc::_exit(code) };
    }
    let meta = VmMeta {
        id,
        pid: pid as u32,
        tag: Some(tag.to_string()),
        created_unix_ms: vms::now_ms(),
    };
    drop(write_end);
    vms::write_meta(&dir, &meta)?;
    Ok((dir, meta, read_end))
}

/// Fork `n` children from the snapshot `tag`; `report` is called (from several threads) as
/// each becomes ready or fails. All children are started first, while this process is still
/// single-threaded; only then do threads wait for them.
pub fn fork_children(
    tag: &str,
    n: usize,
    timeout: Duration,
    report: impl Fn(ChildReport) + Sync,
) -> Result<()> {
    if n == 0 || n > MAX_CHILDREN {
        bail!("-n {n}: ask for 1..={MAX_CHILDREN} children");
    }
    let snap = vms::snapshot_dir(tag)?;
    // Validate once here so a bad snapshot fails the call, not N children.
    tine_vmm::snapshot::file::load_header(&snap)?;
    let mut started = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let (dir, meta, signal) = spawn_child(&snap, tag)?;
        started.push((t, dir, meta, signal));
    }
    std::thread::scope(|s| {
        for (t, dir, meta, signal) in started {
            let report = &report;
            s.spawn(move || {
                let ready = make_ready(&dir, meta.pid, signal, timeout).map(|()| t.elapsed());
                report(ChildReport {
                    id: meta.id,
                    pid: meta.pid,
                    ready,
                });
            });
        }
    });
    Ok(())
}

#[derive(clap::Args)]
pub struct ForkArgs {
    /// Snapshot tag (from `tine snapshot`).
    #[arg(long)]
    tag: String,
    /// Number of children.
    #[arg(short = 'n', long, default_value_t = 1)]
    count: usize,
    #[arg(long, default_value_t = 300)]
    ready_timeout_secs: u64,
    /// Print one JSON object per child instead of a table.
    #[arg(long)]
    json: bool,
    #[arg(long)]
    allow_pvm: bool,
}

pub fn fork(a: ForkArgs) -> Result<i32> {
    refuse_pvm(a.allow_pvm)?;
    let t0 = Instant::now();
    let results = std::sync::Mutex::new((Vec::new(), 0usize));
    let print = |r: ChildReport| {
        let mut g = results.lock().unwrap();
        match &r.ready {
            Ok(d) => {
                g.0.push(*d);
                if a.json {
                    println!(
                        "{{\"id\":{:?},\"pid\":{},\"ready_ms\":{:.3}}}",
                        r.id,
                        r.pid,
                        d.as_secs_f64() * 1e3
                    );
                } else {
                    println!(
                        "{:<28} pid {:<8} ready in {:>9.2} ms",
                        r.id,
                        r.pid,
                        d.as_secs_f64() * 1e3
                    );
                }
            }
            Err(e) => {
                g.1 += 1;
                if a.json {
                    println!("{{\"id\":{:?},\"pid\":{},\"error\":{:?}}}", r.id, r.pid, e);
                } else {
                    println!("{:<28} pid {:<8} FAILED: {e}", r.id, r.pid);
                }
            }
        }
    };
    fork_children(
        &a.tag,
        a.count,
        Duration::from_secs(a.ready_timeout_secs),
        print,
    )?;
    let (mut ok, failed) = results.into_inner().unwrap();
    let total = t0.elapsed();
    ok.sort();
    if !ok.is_empty() && !a.json {
        let p = |q: f64| ok[((ok.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3;
        println!(
            "{} ready, {failed} failed in {:.1} ms (per child p50 {:.1} ms, p90 {:.1} ms, max {:.1} ms)",
            ok.len(),
            total.as_secs_f64() * 1e3,
            p(0.5),
            p(0.9),
            p(1.0)
        );
    }
    Ok(if failed > 0 { 1 } else { 0 })
}

#[derive(clap::Args)]
pub struct LsArgs {}

pub fn ls(_: LsArgs) -> Result<i32> {
    let now = vms::now_ms();
    let vms = vms::list()?;
    println!(
        "{:<28} {:<8} {:<8} {:<20} {:>8}",
        "ID", "PID", "STATE", "SNAPSHOT", "AGE s"
    );
    for (_, m) in &vms {
        println!(
            "{:<28} {:<8} {:<8} {:<20} {:>8.1}",
            m.id,
            m.pid,
            if vms::alive(m.pid) {
                "running"
            } else {
                "exited"
            },
            m.tag.as_deref().unwrap_or("-"),
            now.saturating_sub(m.created_unix_ms) as f64 / 1000.0
        );
    }
    Ok(0)
}

#[derive(clap::Args)]
pub struct KillArgs {
    /// VM ids (see `tine ls`).
    ids: Vec<String>,
    /// Kill every VM.
    #[arg(long, conflicts_with = "ids")]
    all: bool,
}

pub fn kill(a: KillArgs) -> Result<i32> {
    if !a.all && a.ids.is_empty() {
        bail!("name VM ids to kill, or pass --all");
    }
    let targets = if a.all {
        vms::list()?
    } else {
        a.ids
            .iter()
            .map(|id| vms::find(id))
            .collect::<Result<Vec<_>>>()?
    };
    for (dir, m) in &targets {
        vms::kill(dir, m)?;
    }
    eprintln!("[tine] killed {} VM(s)", targets.len());
    Ok(0)
}
