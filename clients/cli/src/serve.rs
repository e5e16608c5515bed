//! The long-running services: `tine up` (embedded default), `tine control-plane`,
//! `tine executor`, and `tine token`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use std::os::unix::fs::DirBuilderExt;

use anyhow::{bail, Context, Result};
use tine_control_plane::calls::Auth;
use tine_control_plane::server::{self, ServerConfig};
use tine_executor::daemon::{self, ExecutorConfig};
use tine_rpc::auth::{self, Role, TokenEntry, TokenSet, TokensFile};
use tine_rpc::tls::TlsFiles;
use tine_rpc::ExecutorId;
use tine_vmm::host::KvmFlavor;

use crate::local;

/// Where an executor serves `/metrics` by default (the control plane's is 9464).
const EXECUTOR_METRICS: &str = "127.0.0.1:9465";

fn pvm_refusal(allow: bool) -> Option<String> {
    (KvmFlavor::detect() == KvmFlavor::Pvm && !allow).then(|| {
        "this executor's /dev/kvm is PVM: Linux guests cannot run here (use a VMX/SVM host or the nested lab)".to_string()
    })
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

async fn until_stopped() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {},
        _ = term.recv() => {},
    }
}

/// The id of `tine up`'s own executor.
const EMBEDDED_EXECUTOR: &str = "local";

/// The tokens of the embedded default: created once (admin + local executor), mode 0600.
fn embedded_tokens(data: &Path) -> Result<(TokenSet, TokensFile, PathBuf)> {
    let path = data.join("tokens.json");
    let admin_file = data.join("admin.token");
    if !path.exists() {
        let file = TokensFile {
            tokens: vec![
                TokenEntry {
                    name: "admin".into(),
                    role: Role::Admin,
                    token: auth::generate_token(),
                },
                TokenEntry {
                    // Bound to the embedded executor's id: it speaks for that executor alone.
                    name: auth::executor_token_name(EMBEDDED_EXECUTOR),
                    role: Role::Executor,
                    token: auth::generate_token(),
                },
            ],
        };
        auth::write_tokens_file(&path, &file)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let (set, file) = TokenSet::load_file(&path)?;
    if let Some(admin) = file.tokens.iter().find(|t| t.role == Role::Admin) {
        auth::write_private_file(&admin_file, admin.token.as_bytes())?;
    }
    Ok((set, file, admin_file))
}

#[derive(clap::Args)]
pub struct UpArgs {
    /// Where the database, audit log, tokens, snapshots and VMs live ($TINE_DATA_DIR or
    /// ~/.local/share/tine).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// Prometheus metrics endpoint of the control plane.
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_listen: SocketAddr,
    /// Prometheus metrics endpoint of the local executor (spawn phases, pool, VMs).
    #[arg(long, default_value = EXECUTOR_METRICS)]
    executor_metrics_listen: SocketAddr,
    /// Most sandboxes the local executor runs at once.
    #[arg(long, default_value_t = 256)]
    max_sandboxes: u32,
    #[command(flatten)]
    lifetimes: LifetimeArgs,
    #[command(flatten)]
    pool: PoolArgs,
    /// Most memory (MiB of image data) held as copies of hot snapshots' memory in huge
    /// pages, which their children map 2 MiB at a time; only where shared memory may use
    /// transparent huge pages (`tine doctor`). 0: off.
    #[arg(long, default_value_t = 2048)]
    hot_image_mib: u64,
    /// Let the host's KSM daemon merge identical pages that children wrote (needs
    /// /sys/kernel/mm/ksm/run = 1; `tine doctor`). Off by default: merging costs that
    /// daemon's CPU, and pages merged across tenants let one child time another's writes.
    #[arg(long)]
    merge_pages: bool,
    /// Do not prime idle VMM workers for the snapshot last spawned from. Priming restores
    /// it ahead up to what needs the child and maps its working set; each primed worker
    /// holds those pages (under 1 MiB for python-numpy), charged to the executor, not to a
    /// child's cgroup.
    #[arg(long)]
    no_prime: bool,
    /// Seconds after each child's guest starts to give back the guest RAM pages its VMM holds
    /// unchanged from the snapshot (written back as they were, or copied ahead with the working
    /// set and never changed), inside one short pause; 0: never.
    #[arg(long, default_value_t = 2.0, value_parser = crate::local::parse_give_back_after)]
    give_back_after: f64,
    /// How VMM workers are started: fork (from a zygote that loaded the worker program once,
    /// so workers share the pages its loading wrote: about 0.15 MiB less per child) or exec
    /// (each from the program, with an address-space layout of its own).
    #[arg(long, default_value_t = tine_host::WorkerStart::Fork)]
    worker_start: tine_host::WorkerStart,
    /// Start even though /dev/kvm is PVM (VM calls will fail).
    #[arg(long)]
    allow_pvm: bool,
    /// Children's cgroups: auto (this process's own cgroup if nothing else runs in it,
    /// else tine-<hash> at the top of cgroup v2), off, or a cgroup v2 directory to use.
    #[arg(long, default_value = "auto")]
    cgroup: String,
    #[command(flatten)]
    net: local::NetArgs,
    #[command(flatten)]
    confine: local::ConfineArgs,
}

/// The children's cgroups: none where no VM can run (a PVM host), so nothing is touched.
fn child_cgroups(flag: &str, refusal: &Option<String>) -> tine_host::CgroupMode {
    match refusal {
        Some(_) => tine_host::CgroupMode::Off,
        None => local::cgroup_mode(flag),
    }
}

/// The executor's child networks: none where it cannot run VMs (a PVM host), so nothing is
/// set up on a machine that will never use it.
fn child_networks(
    net: &local::NetArgs,
    refusal: &Option<String>,
    internet: bool,
    control_plane: Option<&str>,
) -> Result<Option<tine_host::network::NetConfig>> {
    if refusal.is_some() {
        return Ok(None);
    }
    net.config(internet, control_plane)
}

pub fn up(a: UpArgs) -> Result<i32> {
    let data = local::data_dir(a.data_dir.clone())?;
    // Made private: it holds the tokens, the database and the snapshots.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&data)
        .with_context(|| format!("creating {}", data.display()))?;
    let data = data.canonicalize()?;
    // One `tine up` per data directory, before anything in it is touched.
    let _lock = tine_host::pidlock::lock(&data, "up.lock").map_err(|e| match e {
        tine_host::pidlock::LockError::Held { pid, .. } => anyhow::anyhow!(
            "another `tine up` (pid {}) is using {}: stop it first, or give another --data-dir",
            tine_host::pidlock::holder(pid),
            data.display()
        ),
        e => anyhow::Error::new(e),
    })?;
    let (token_set, tokens, admin_file) = embedded_tokens(&data)?;
    let executor_token = tokens
        .tokens
        .iter()
        .find(|t| t.role == Role::Executor)
        .map(|t| t.token.clone())
        .context("tokens.json has no executor token")?;
    let rt = runtime()?;
    rt.block_on(async {
        let _telemetry = tine_rpc::telemetry::init("tine", "info")?;
        let cp = server::start(ServerConfig {
            listen: a.listen,
            db_path: data.join("tine.db"),
            auth: Auth::Tokens(token_set),
            audit_path: data.join("audit.log"),
            metrics_listen: Some(a.metrics_listen),
            // Embedded mode listens on loopback; multi-host setups use `tine control-plane`.
            tls: None,
            executor_token: Some(executor_token.clone()),
            executor_tokens: Default::default(),
            executor_ca: None,
            heartbeat_interval_s: 5,
            lost_grace_ms: tine_control_plane::db::LOST_GRACE_MS,
            allow_plaintext_remote: false,
            sandbox_timeouts: a.lifetimes.timeouts()?,
        })
        .await?;
        let id = ExecutorId::parse(EMBEDDED_EXECUTOR)?;
        let ex = daemon::start(ExecutorConfig {
            id: id.clone(),
            listen: "127.0.0.1:0".parse()?,
            advertise: None,
            token: Some(executor_token),
            control_plane: Some(format!("http://{}", cp.addr)),
            control_plane_ca: None,
            tls: None,
            // The embedded default keeps its store beside everything else.
            host: tine_host::HostConfig {
                confine: a.confine.confinement()?,
                ..local::executor_host(
                &id,
                data.clone(),
                tine_host::Limits {
                    max_vms: a.max_sandboxes,
                    pool_size: a.pool.pool,
                    pool_max: a.pool.pool_max,
                    pool_shrink_after: std::time::Duration::from_secs(a.pool.pool_shrink_secs),
                    hot_image_mib: a.hot_image_mib,
                    merge_pages: a.merge_pages,
                    prime_workers: !a.no_prime,
                    give_back_after: local::give_back_after(a.give_back_after),
                    worker_start: a.worker_start,
                    ..tine_host::Limits::default()
                },
                // One host: its snapshots are always here.
                Some(local::StoreChoice {
                    url: data.join("store").display().to_string(),
                    fetch: tine_host::FetchMode::Eager,
                    cache_max_bytes: None,
                    gc_grace: tine_host::DEFAULT_GC_GRACE,
                }),
                // One user's machine: children reach the internet unless told otherwise.
                child_networks(&a.net, &pvm_refusal(a.allow_pvm), true, None)?,
                child_cgroups(&a.cgroup, &pvm_refusal(a.allow_pvm)),
            )?
            },
            metrics_listen: Some(a.executor_metrics_listen),
            allow_plaintext_remote: false,
            vm_refusal: pvm_refusal(a.allow_pvm),
        })
        .await?;
        let cp_url = format!("http://{}", cp.addr);
        // Where a local `tine` finds this instance when TINE_ADDR is not set.
        let up_file = data.join("up.json");
        let info = serde_json::json!({
            "addr": cp_url,
            "metrics": cp.metrics_addr.map(|m| m.to_string()),
            "executor_metrics": ex.metrics_addr.map(|m| m.to_string()),
            "token_file": admin_file,
            "pid": std::process::id(),
        });
        auth::write_private_file(&up_file, info.to_string().as_bytes())?;
        println!("TINE_ADDR={cp_url}");
        println!("TINE_TOKEN_FILE={}", admin_file.display());
        eprintln!(
            "[tine] up: control plane {cp_url}, metrics http://{}/metrics, executor \"local\" on {} (metrics http://{}/metrics)\n\
             [tine] admin token in {} (mode 0600); data in {}\n\
             [tine] try: TINE_ADDR={cp_url} tine snapshots ls",
            cp.metrics_addr.map(|m| m.to_string()).unwrap_or_default(),
            ex.addr,
            ex.metrics_addr.map(|m| m.to_string()).unwrap_or_default(),
            admin_file.display(),
            data.display()
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        until_stopped().await;
        eprintln!("[tine] stopping: killing local sandboxes");
        let _ = std::fs::remove_file(&up_file);
        ex.shutdown(true).await?;
        cp.shutdown().await?;
        Ok::<_, anyhow::Error>(0)
    })
}

#[derive(clap::Args)]
pub struct ControlPlaneArgs {
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: SocketAddr,
    /// SQLite database file.
    #[arg(long)]
    db: PathBuf,
    /// Tokens file (JSON, mode 0600): {"tokens": [{"name", "role": admin|user|executor, "token"}]}.
    #[arg(long, required_unless_present = "no_auth")]
    tokens: Option<PathBuf>,
    /// No authentication (refused unless listening on loopback).
    #[arg(long)]
    no_auth: bool,
    #[arg(long)]
    audit_log: PathBuf,
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// CA for executors served over https.
    #[arg(long)]
    executor_ca: Option<PathBuf>,
    /// Name of the tokens-file entry (role executor) presented to executors.
    #[arg(long, default_value = "executors")]
    executor_token_name: String,
    #[arg(long, default_value_t = 5)]
    heartbeat_interval_s: u32,
    /// Seconds a ready sandbox its executor stopped reporting is given before it is marked
    /// lost (a heartbeat racing a spawn must not condemn a new child).
    #[arg(long, default_value_t = 30)]
    lost_grace_secs: u32,
    #[arg(long)]
    allow_plaintext_remote: bool,
    #[command(flatten)]
    lifetimes: LifetimeArgs,
}

/// The executor's pool of pre-started VMM workers (`tine up`, `tine executor`).
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct PoolArgs {
    /// VMM worker processes kept started (and primed for the snapshot last spawned from) for
    /// fast spawns; 0: one is started per spawn.
    #[arg(long, default_value_t = 8)]
    pool: usize,
    /// Most workers the pool grows to after spawns found it short: it grows by as many as
    /// they had to start, so the next burst of that size finds them ready (at most --pool:
    /// it never grows).
    #[arg(long, default_value_t = 32)]
    pool_max: usize,
    /// A grown pool goes back to --pool once no spawn found it short for this many seconds.
    #[arg(long, default_value_t = 300)]
    pool_shrink_secs: u64,
}

/// How long sandboxes live (`tine up`, `tine control-plane`).
#[derive(clap::Args, Clone, Copy, Debug)]
pub struct LifetimeArgs {
    /// Seconds a sandbox lives when its spawn does not say (0: until killed).
    #[arg(long, default_value_t = 300)]
    sandbox_timeout_secs: u32,
    /// The most a spawn or SetTimeout may ask for, in seconds.
    #[arg(long, default_value_t = 86_400)]
    max_sandbox_timeout_secs: u32,
    /// Seconds an ended sandbox stays listed (`tine ps --all`) before it is forgotten (0:
    /// forever; the audit log keeps every call either way).
    #[arg(long, default_value_t = 7 * 86_400)]
    history_retention_secs: u32,
}

impl LifetimeArgs {
    fn timeouts(self) -> Result<tine_control_plane::server::SandboxTimeouts> {
        anyhow::ensure!(
            self.max_sandbox_timeout_secs >= 1
                && self.sandbox_timeout_secs <= self.max_sandbox_timeout_secs,
            "--sandbox-timeout-secs {} must be at most --max-sandbox-timeout-secs {} (at least 1)",
            self.sandbox_timeout_secs,
            self.max_sandbox_timeout_secs
        );
        Ok(tine_control_plane::server::SandboxTimeouts {
            default_s: self.sandbox_timeout_secs,
            max_s: self.max_sandbox_timeout_secs,
            history_s: self.history_retention_secs,
        })
    }
}

pub fn control_plane(a: ControlPlaneArgs) -> Result<i32> {
    let (auth, executor_token, executor_tokens) = match &a.tokens {
        Some(p) => {
            let (set, file) = TokenSet::load_file(p)?;
            let t = file
                .tokens
                .iter()
                .find(|t| t.name == a.executor_token_name && t.role == Role::Executor)
                .map(|t| t.token.clone());
            // An executor with a token of its own is called with that token.
            let own: std::collections::HashMap<String, String> = file
                .tokens
                .iter()
                .filter(|t| t.role == Role::Executor)
                .filter_map(|t| Some((auth::bound_executor(&t.name)?.to_string(), t.token.clone())))
                .collect();
            if t.is_none() && own.is_empty() {
                eprintln!(
                    "[tine] warning: no token named {:?} or executor:ID with role executor: calls to executors carry no token",
                    a.executor_token_name
                );
            }
            (Auth::Tokens(set), t, own)
        }
        None => (Auth::Disabled, None, Default::default()),
    };
    runtime()?.block_on(async {
        let _telemetry = tine_rpc::telemetry::init("tine-control-plane", "info")?;
        let cp = server::start(ServerConfig {
            listen: a.listen,
            db_path: a.db.clone(),
            auth,
            audit_path: a.audit_log.clone(),
            metrics_listen: a.metrics_listen,
            tls: TlsFiles::from_args(a.tls_cert.clone(), a.tls_key.clone())?,
            executor_token,
            executor_tokens,
            executor_ca: a.executor_ca.clone(),
            heartbeat_interval_s: a.heartbeat_interval_s,
            lost_grace_ms: i64::from(a.lost_grace_secs) * 1000,
            allow_plaintext_remote: a.allow_plaintext_remote,
            sandbox_timeouts: a.lifetimes.timeouts()?,
        })
        .await?;
        println!(
            "TINE_ADDR={}://{}",
            if a.tls_cert.is_some() {
                "https"
            } else {
                "http"
            },
            cp.addr
        );
        use std::io::Write;
        let _ = std::io::stdout().flush();
        until_stopped().await;
        cp.shutdown().await?;
        Ok(0)
    })
}

#[derive(clap::Args)]
pub struct ExecutorArgs {
    /// Executor id (default: the host name).
    #[arg(long)]
    id: Option<ExecutorId>,
    /// Where snapshots and VM records live ($TINE_DATA_DIR or ~/.local/share/tine). One
    /// executor per data directory.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Prometheus metrics endpoint (spawn phases, pool, VMs).
    #[arg(long, default_value = EXECUTOR_METRICS)]
    metrics_listen: SocketAddr,
    /// The cluster's snapshot store, shared by every executor: a directory, file:///dir or
    /// s3://bucket[/prefix] (AWS_* variables). Snapshots made here are pushed to it as layers,
    /// and snapshots this host lacks are fetched from it. Without it snapshots stay here.
    #[arg(long, env = "TINE_STORE")]
    store: Option<String>,
    /// How a snapshot found only in the store is restored here: `eager` (fetch and assemble
    /// the whole image first), `lazy` (start children at once, pages arrive on first touch
    /// through userfaultfd, the recorded working set copied in first; the image fills in in
    /// the background) or `lazy-no-prefetch`.
    #[arg(long, env = "TINE_FETCH", default_value = "eager")]
    fetch: tine_host::FetchMode,
    /// Bound on this host's layer cache (fetched layers and assembled images), e.g. 50GiB;
    /// snapshots no child here runs from are evicted first, least recently used first, and
    /// fetched again when next needed. `none`: unbounded.
    #[arg(long, env = "TINE_LAYER_CACHE_MAX", default_value = "32GiB", value_parser = parse_cache_bound)]
    layer_cache_max: CacheBound,
    /// Layers of deleted snapshots leave the store and this host's cache once this old (seconds;
    /// a push in progress also holds collection off); collected this often.
    #[arg(long, default_value_t = 3600)]
    gc_grace_secs: u64,
    #[arg(long, default_value = "127.0.0.1:7071")]
    listen: SocketAddr,
    /// Address the control plane uses to reach this executor (default http(s)://<listen>).
    #[arg(long)]
    advertise: Option<String>,
    /// Control plane to register with, e.g. http://10.0.0.1:7070.
    #[arg(long)]
    control_plane: Option<String>,
    /// File holding the cluster's executor token (or set TINE_EXECUTOR_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
    #[arg(long)]
    control_plane_ca: Option<PathBuf>,
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    #[arg(long)]
    tls_key: Option<PathBuf>,
    #[arg(long, default_value_t = 256)]
    max_sandboxes: u32,
    #[command(flatten)]
    pool: PoolArgs,
    /// Most memory (MiB of image data) held as copies of hot snapshots' memory in huge
    /// pages, which their children map 2 MiB at a time; only where shared memory may use
    /// transparent huge pages (`tine doctor`). 0: off.
    #[arg(long, default_value_t = 2048)]
    hot_image_mib: u64,
    /// Let the host's KSM daemon merge identical pages that children wrote (needs
    /// /sys/kernel/mm/ksm/run = 1; `tine doctor`). Off by default: merging costs that
    /// daemon's CPU, and pages merged across tenants let one child time another's writes.
    #[arg(long)]
    merge_pages: bool,
    /// Do not prime idle VMM workers for the snapshot last spawned from. Priming restores
    /// it ahead up to what needs the child and maps its working set; each primed worker
    /// holds those pages (under 1 MiB for python-numpy), charged to the executor, not to a
    /// child's cgroup.
    #[arg(long)]
    no_prime: bool,
    /// Seconds after each child's guest starts to give back the guest RAM pages its VMM holds
    /// unchanged from the snapshot (written back as they were, or copied ahead with the working
    /// set and never changed), inside one short pause; 0: never.
    #[arg(long, default_value_t = 2.0, value_parser = crate::local::parse_give_back_after)]
    give_back_after: f64,
    /// How VMM workers are started: fork (from a zygote that loaded the worker program once,
    /// so workers share the pages its loading wrote: about 0.15 MiB less per child) or exec
    /// (each from the program, with an address-space layout of its own).
    #[arg(long, default_value_t = tine_host::WorkerStart::Fork)]
    worker_start: tine_host::WorkerStart,
    #[arg(long)]
    allow_plaintext_remote: bool,
    #[arg(long)]
    allow_pvm: bool,
    /// Children's cgroups: auto, off, or a cgroup v2 directory (see `tine up --help`).
    #[arg(long, default_value = "auto")]
    cgroup: String,
    /// When a child counts as ready: `agent` (its guest agent answered and fixed up the clone)
    /// or `running` (its VMM runs the restored guest: snapshots of guests without the agent).
    #[arg(long, value_enum, default_value_t = ReadinessArg::Agent)]
    readiness: ReadinessArg,
    #[command(flatten)]
    net: local::NetArgs,
    #[command(flatten)]
    confine: local::ConfineArgs,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum ReadinessArg {
    Agent,
    Running,
}

pub fn executor(a: ExecutorArgs) -> Result<i32> {
    let token = match (&a.token_file, std::env::var("TINE_EXECUTOR_TOKEN")) {
        (Some(p), _) => Some(tine_rpc::auth::read_token_file(p)?),
        (None, Ok(t)) => Some(t),
        (None, Err(_)) => None,
    };
    let id = match a.id {
        Some(id) => id,
        None => ExecutorId::parse(
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_else(|_| "executor".into()),
        )
        .context("the host name is not a valid executor id: give --id")?,
    };
    let data = local::data_dir(a.data_dir.clone())?;
    runtime()?.block_on(async {
        let _telemetry = tine_rpc::telemetry::init("tine-executor", "info")?;
        let ex = daemon::start(ExecutorConfig {
            id: id.clone(),
            listen: a.listen,
            advertise: a.advertise.clone(),
            token,
            control_plane: a.control_plane.clone(),
            control_plane_ca: a.control_plane_ca.clone(),
            tls: TlsFiles::from_args(a.tls_cert.clone(), a.tls_key.clone())?,
            host: tine_host::HostConfig {
                confine: a.confine.confinement()?,
                readiness: match a.readiness {
                    ReadinessArg::Agent => tine_host::Readiness::Agent,
                    ReadinessArg::Running => tine_host::Readiness::Running,
                },
                ..local::executor_host(
                    &id,
                    data,
                    tine_host::Limits {
                        max_vms: a.max_sandboxes,
                        pool_size: a.pool.pool,
                        pool_max: a.pool.pool_max,
                        pool_shrink_after: std::time::Duration::from_secs(a.pool.pool_shrink_secs),
                        hot_image_mib: a.hot_image_mib,
                        merge_pages: a.merge_pages,
                        prime_workers: !a.no_prime,
                        give_back_after: local::give_back_after(a.give_back_after),
                        worker_start: a.worker_start,
                        ..tine_host::Limits::default()
                    },
                    a.store.clone().map(|url| local::StoreChoice {
                        url,
                        fetch: a.fetch,
                        cache_max_bytes: a.layer_cache_max.0,
                        gc_grace: std::time::Duration::from_secs(a.gc_grace_secs),
                    }),
                    // Several tenants: no internet unless the operator or a spawn allows it.
                    child_networks(
                        &a.net,
                        &pvm_refusal(a.allow_pvm),
                        false,
                        a.control_plane.as_deref(),
                    )?,
                    child_cgroups(&a.cgroup, &pvm_refusal(a.allow_pvm)),
                )?
            },
            metrics_listen: Some(a.metrics_listen),
            allow_plaintext_remote: a.allow_plaintext_remote,
            vm_refusal: pvm_refusal(a.allow_pvm),
        })
        .await?;
        eprintln!("[tine] executor listening on {}", ex.addr);
        until_stopped().await;
        // Children keep running; a restarted daemon re-adopts them.
        ex.shutdown(false).await?;
        Ok(0)
    })
}

#[derive(clap::Subcommand)]
pub enum TokenCommand {
    /// Print a new random token, or add it to a tokens file.
    New {
        /// Add it to this tokens file (created with mode 0600) instead of printing only.
        #[arg(long)]
        file: Option<PathBuf>,
        #[arg(long, requires = "file")]
        name: Option<String>,
        #[arg(long, value_enum, default_value = "user")]
        role: RoleArg,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum RoleArg {
    Admin,
    User,
    Executor,
}

pub fn token(c: TokenCommand) -> Result<i32> {
    let TokenCommand::New { file, name, role } = c;
    let token = auth::generate_token();
    if let Some(path) = file {
        let mut f: TokensFile = if path.exists() {
            TokenSet::load_file(&path)?.1
        } else {
            TokensFile::default()
        };
        let name = name.context("--name is needed with --file")?;
        if f.tokens.iter().any(|t| t.name == name) {
            bail!("{} already has a token named {name:?}", path.display());
        }
        f.tokens.push(TokenEntry {
            name,
            role: match role {
                RoleArg::Admin => Role::Admin,
                RoleArg::User => Role::User,
                RoleArg::Executor => Role::Executor,
            },
            token: token.clone(),
        });
        auth::write_tokens_file(&path, &f)?;
    }
    println!("{token}");
    Ok(0)
}

/// `--layer-cache-max`: bytes, or None for unbounded.
#[derive(Clone, Copy, Debug)]
pub struct CacheBound(Option<u64>);

/// A size such as `512MiB`, `50GiB`, `1TiB`, `1000000` (bytes), or `none`.
fn parse_cache_bound(s: &str) -> std::result::Result<CacheBound, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(CacheBound(None));
    }
    let digits = s.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &s[digits.len()..];
    let shift = match unit {
        "" | "B" => 0,
        "KiB" => 10,
        "MiB" => 20,
        "GiB" => 30,
        "TiB" => 40,
        other => {
            return Err(format!(
                "unknown unit {other:?} (B, KiB, MiB, GiB, TiB, or `none`)"
            ))
        }
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a size such as 50GiB"))?;
    n.checked_mul(1 << shift)
        .filter(|&b| b > 0)
        .map(|b| CacheBound(Some(b)))
        .ok_or_else(|| format!("{s:?} is out of range"))
}

#[cfg(test)]
mod cache_bound_tests {
    use super::parse_cache_bound;

    #[test]
    fn sizes_parse_and_nonsense_is_refused() {
        assert_eq!(parse_cache_bound("32GiB").unwrap().0, Some(32 << 30));
        assert_eq!(parse_cache_bound("4096").unwrap().0, Some(4096));
        assert_eq!(parse_cache_bound("none").unwrap().0, None);
        assert!(parse_cache_bound("0").is_err());
        assert!(parse_cache_bound("12GB")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_cache_bound("xGiB").is_err());
        assert!(parse_cache_bound("99999999999TiB")
            .unwrap_err()
            .contains("out of range"));
    }
}
