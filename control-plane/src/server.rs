//! Assemble and run the control plane: gRPC services (with health and reflection), the
//! metrics endpoint, SIGHUP audit reopening, and the safety checks on where it listens.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tine_proto::v1::executors_server::ExecutorsServer;
use tine_proto::v1::sandboxes_server::SandboxesServer;
use tine_proto::v1::snapshots_server::SnapshotsServer;
use tokio::sync::oneshot;
use tonic::transport::Server;

use crate::api::Api;
use crate::audit::AuditLog;
pub use crate::calls::SandboxTimeouts;
use crate::calls::{Auth, Ctx, Keeper};
use crate::db::Db;
use crate::executors::ExecutorPool;
use crate::metrics::Metrics;
use tine_rpc::gate::GateLayer;
use tine_rpc::limits::MAX_MESSAGE_BYTES;
use tine_rpc::tls::check_listen;
pub use tine_rpc::tls::TlsFiles;

pub struct ServerConfig {
    pub listen: SocketAddr,
    pub db_path: PathBuf,
    pub auth: Auth,
    pub audit_path: PathBuf,
    /// Where `/metrics` is served (None: not served).
    pub metrics_listen: Option<SocketAddr>,
    pub tls: Option<TlsFiles>,
    /// The secret presented to executors (role "executor" in the tokens file).
    pub executor_token: Option<String>,
    /// Executors' own tokens by executor id (entries named `executor:ID`), presented to that
    /// executor instead.
    pub executor_tokens: std::collections::HashMap<String, String>,
    /// CA that signed the executors' certificates, for https:// executor addresses.
    pub executor_ca: Option<PathBuf>,
    pub heartbeat_interval_s: u32,
    /// See `db::LOST_GRACE_MS` (the default).
    pub lost_grace_ms: i64,
    /// Serve plaintext gRPC on a non-loopback address (tokens would cross the network in clear).
    pub allow_plaintext_remote: bool,
    /// How long sandboxes live.
    pub sandbox_timeouts: SandboxTimeouts,
}

/// Refuse configurations that would expose the API unsafely.
pub fn check_exposure(cfg: &ServerConfig) -> Result<()> {
    check_listen(
        cfg.listen,
        matches!(cfg.auth, Auth::Tokens(_)),
        cfg.tls.is_some(),
        cfg.allow_plaintext_remote,
    )
}

pub struct RunningServer {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    pub ctx: Arc<Ctx>,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningServer {
    /// Stop accepting calls, let running ones finish, close the database.
    pub async fn shutdown(mut self) -> Result<()> {
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        for b in &self.background {
            b.abort();
        }
        (&mut self.task).await.context("server task")??;
        self.ctx.db.close().await;
        Ok(())
    }
}

pub async fn start(cfg: ServerConfig) -> Result<RunningServer> {
    check_exposure(&cfg)?;
    if let Some(dir) = cfg.db_path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let db = Db::open(&cfg.db_path)
        .await
        .with_context(|| format!("opening the database {}", cfg.db_path.display()))?;
    // Nothing is being spawned yet: any child still starting was a dead process's.
    let interrupted = db
        .fail_interrupted_spawns()
        .await
        .context("failing the spawns a previous run left unfinished")?;
    if interrupted > 0 {
        tracing::warn!(
            sandboxes = interrupted,
            "children of spawns cut short by the last stop are failed (their executors kill them)"
        );
    }
    // Likewise no call waits for a snapshot being written any more.
    let unfinished = db
        .fail_interrupted_snapshots()
        .await
        .context("failing the snapshots a previous run left being written")?;
    if unfinished > 0 {
        tracing::warn!(
            snapshots = unfinished,
            "snapshots whose writing the last stop cut short are failed (create them again)"
        );
    }
    let audit = AuditLog::open(&cfg.audit_path)
        .with_context(|| format!("opening the audit log {}", cfg.audit_path.display()))?;
    let executor_tls = cfg
        .executor_ca
        .as_deref()
        .map(tine_rpc::tls::client_config)
        .transpose()?;
    let executors = ExecutorPool::new(
        cfg.executor_token.as_deref(),
        &cfg.executor_tokens,
        executor_tls,
    )
    .map_err(|e| anyhow::anyhow!("executor token: {e}"))?;
    let metrics = Arc::new(Metrics::new());
    let ctx = Arc::new(Ctx {
        db,
        auth: cfg.auth,
        audit,
        metrics: metrics.clone(),
        executors,
        heartbeat_interval_s: cfg.heartbeat_interval_s.max(1),
        lost_grace_ms: cfg.lost_grace_ms,
        timeouts: cfg.sandbox_timeouts,
    });
    let api = Api { ctx: ctx.clone() };

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<SnapshotsServer<Api>>().await;
    health.set_serving::<SandboxesServer<Api>>().await;
    health.set_serving::<ExecutorsServer<Api>>().await;
    // grpcurl 1.8 speaks only v1alpha reflection, newer tools v1: serve both.
    let reflection = |b: tonic_reflection::server::Builder<'static>| {
        b.register_encoded_file_descriptor_set(tine_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure()).build_v1()?;
    let reflection_v1alpha =
        reflection(tonic_reflection::server::Builder::configure()).build_v1alpha()?;

    let connections = tine_rpc::conn::Connections::default();
    let mut builder = connections.server(
        Server::builder().trace_fn(|req| tine_rpc::telemetry::request_span(req, "control-plane")),
    );
    if let Some(tls) = &cfg.tls {
        builder = builder.tls_config(tls.server_config()?)?;
    }
    let router = builder
        .layer(GateLayer::new(Arc::new(Keeper(ctx.clone()))))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(
            SnapshotsServer::new(api.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            SandboxesServer::new(api.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            ExecutorsServer::new(api.clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        );
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(router.serve_with_incoming_shutdown(
        connections.incoming(listener),
        async {
            let _ = rx.await;
        },
    ));

    let mut background = Vec::new();
    let mut metrics_addr = None;
    if let Some(m) = cfg.metrics_listen {
        let (bound, t) = tine_rpc::metrics::serve(m, metrics.registry().clone())
            .await
            .with_context(|| format!("binding the metrics listener {m}"))?;
        metrics_addr = Some(bound);
        background.push(t);
    }
    background.push(tokio::spawn(reopen_audit_on_sighup(ctx.clone())));
    background.push(tokio::spawn(refresh_gauges(api.clone())));
    background.push(tokio::spawn(expire_sandboxes(api.clone())));
    background.push(tokio::spawn(forget_history(api)));
    tracing::info!(%addr, "control plane listening");
    Ok(RunningServer {
        addr,
        metrics_addr,
        ctx,
        shutdown: Some(tx),
        task,
        background,
    })
}

async fn reopen_audit_on_sighup(ctx: Arc<Ctx>) {
    use tokio::signal::unix::{signal, SignalKind};
    let Ok(mut hup) = signal(SignalKind::hangup()) else {
        tracing::warn!("cannot watch SIGHUP: the audit log will not be reopened on rotation");
        return;
    };
    while hup.recv().await.is_some() {
        match ctx.audit.reopen() {
            Ok(()) => tracing::info!(path = %ctx.audit.path().display(), "audit log reopened"),
            Err(e) => tracing::error!("reopening the audit log: {e}"),
        }
    }
}

/// Kill sandboxes whose timeout ran out, every half second. Expiries live in the database, so
/// ones that came due while no control plane ran are killed at the next start.
async fn expire_sandboxes(api: Api) {
    loop {
        api.expire_due().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Forget sandboxes that ended longer ago than the history retention, at start and then every
/// minute, so the sandboxes table (and ListSandboxes with `all`) stays bounded. Each pass then
/// finds about a minute's worth, forgotten in small batches between the calls' writes.
async fn forget_history(api: Api) {
    let history_s = api.ctx.timeouts.history_s;
    if history_s == 0 {
        return;
    }
    loop {
        let cutoff = crate::now_ms() - i64::from(history_s) * 1000;
        let counted = |n| api.ctx.metrics.sandboxes_forgotten.inc_by(n);
        match api.ctx.db.forget_ended_before(cutoff, counted).await {
            Ok(0) => {}
            Ok(n) => tracing::info!(forgotten = n, "sandboxes past the history retention"),
            Err(e) => tracing::warn!("forgetting old sandboxes: {e}"),
        }
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
}

/// Keep the gauges current (they are read by scrapes, not by calls).
async fn refresh_gauges(api: Api) {
    let period = Duration::from_secs(api.ctx.heartbeat_interval_s as u64);
    loop {
        if let Ok(n) = api.ctx.db.count_live_sandboxes().await {
            api.ctx.metrics.sandboxes_active.set(n);
        }
        if let Ok(ex) = api.ctx.db.executors().await {
            let up = ex.iter().filter(|e| api.is_up(e)).count();
            api.ctx.metrics.executors_up.set(up as i64);
        }
        tokio::time::sleep(period).await;
    }
}
