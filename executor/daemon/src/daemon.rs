//! Running the executor daemon: serve the executor API, keep the VMM worker pool warm, reap
//! exited children, and register + heartbeat with the control plane.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tine_control_plane::auth::{Role, TokenEntry, TokenSet};
use tine_control_plane::executors::Bearer;
use tine_control_plane::server::TlsFiles;
use tine_proto::executor::v1::executor_server::ExecutorServer;
use tine_proto::v1 as pb;
use tine_proto::v1::executors_client::ExecutorsClient;
use tokio::sync::oneshot;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Server};

use crate::service::{ExecutorService, State};
use crate::worker::WorkerPool;

pub struct ExecutorConfig {
    pub id: String,
    pub listen: SocketAddr,
    /// How the control plane reaches this executor (default: http://<listen>).
    pub advertise: Option<String>,
    /// Accepted from the control plane and presented to it (role "executor").
    pub token: Option<String>,
    /// The control plane to register with (http(s)://host:port); None: standalone.
    pub control_plane: Option<String>,
    pub control_plane_ca: Option<PathBuf>,
    pub tls: Option<TlsFiles>,
    pub max_sandboxes: u32,
    /// Idle VMM worker processes kept started.
    pub pool_size: usize,
    /// The `tine` binary that runs `__vmm-worker`.
    pub worker_exe: PathBuf,
    pub allow_plaintext_remote: bool,
    /// Refuse VM work with this message (e.g. PVM hosts).
    pub vm_refusal: Option<String>,
}

pub struct RunningExecutor {
    pub addr: SocketAddr,
    pub state: Arc<State>,
    shutdown: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
    background: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningExecutor {
    /// Stop serving; with `kill_sandboxes`, also stop every child (otherwise they keep
    /// running and a restarted daemon re-adopts them).
    pub async fn shutdown(mut self, kill_sandboxes: bool) -> Result<()> {
        for b in &self.background {
            b.abort();
        }
        if let Some(s) = self.shutdown.take() {
            let _ = s.send(());
        }
        (&mut self.task).await.context("executor server task")??;
        if kill_sandboxes {
            let st = self.state.clone();
            tokio::task::spawn_blocking(move || st.kill_all()).await?;
        }
        Ok(())
    }
}

pub async fn start(cfg: ExecutorConfig) -> Result<RunningExecutor> {
    tine_snapshot_store::tag::validate_tag(&cfg.id)
        .map_err(|e| anyhow::anyhow!("executor id: {e}"))?;
    tine_control_plane::server::check_listen(
        cfg.listen,
        cfg.token.is_some(),
        cfg.tls.is_some(),
        cfg.allow_plaintext_remote,
    )?;
    let tokens = match &cfg.token {
        Some(t) => Some(Arc::new(TokenSet::new(&[TokenEntry {
            name: "control-plane".into(),
            role: Role::Executor,
            token: t.clone(),
        }])?)),
        None => None,
    };
    let pool = WorkerPool::new(cfg.worker_exe.clone(), cfg.pool_size);
    let state = State::new(
        cfg.id.clone(),
        cfg.max_sandboxes,
        pool.clone(),
        cfg.vm_refusal.clone(),
    );
    if cfg.vm_refusal.is_none() {
        let p = pool.clone();
        tokio::task::spawn_blocking(move || p.refill());
    }

    let svc = ExecutorServer::new(ExecutorService {
        state: state.clone(),
    })
    .max_decoding_message_size(8 << 20)
    .max_encoding_message_size(8 << 20);
    let check = move |req: tonic::Request<()>| -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(t) = &tokens {
            t.authenticate(req.metadata())?;
        }
        Ok(req)
    };
    let mut builder = Server::builder()
        .trace_fn(|req| tine_control_plane::telemetry::request_span(req, "executor"));
    if let Some(tls) = &cfg.tls {
        builder = builder.tls_config(tls.server_config()?)?;
    }
    let router = builder.add_service(tonic::service::interceptor::InterceptedService::new(
        svc, check,
    ));
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    let addr = listener.local_addr()?;
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(router.serve_with_incoming_shutdown(
        tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        async {
            let _ = rx.await;
        },
    ));

    let mut background = Vec::new();
    let st = state.clone();
    background.push(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let s = st.clone();
            let _ = tokio::task::spawn_blocking(move || s.reap()).await;
        }
    }));
    if let Some(cp) = &cfg.control_plane {
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let advertise = cfg
            .advertise
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{addr}"));
        let channel = control_plane_channel(cp, cfg.control_plane_ca.as_ref())?;
        let client = ExecutorsClient::with_interceptor(
            channel,
            Bearer::new(cfg.token.as_deref()).map_err(|e| anyhow::anyhow!(e))?,
        );
        background.push(tokio::spawn(registration_loop(
            client,
            cfg.id.clone(),
            advertise,
            state.clone(),
        )));
    }
    tracing::info!(%addr, id = %cfg.id, "executor listening");
    Ok(RunningExecutor {
        addr,
        state,
        shutdown: Some(tx),
        task,
        background,
    })
}

fn control_plane_channel(addr: &str, ca: Option<&PathBuf>) -> Result<tonic::transport::Channel> {
    let mut ep = Endpoint::from_shared(addr.to_string())
        .with_context(|| format!("control plane address {addr:?}"))?
        .connect_timeout(Duration::from_secs(5));
    if addr.starts_with("https://") {
        let Some(ca) = ca else {
            bail!("the control plane {addr} speaks TLS: give --control-plane-ca");
        };
        let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
        ep = ep.tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)))?;
    }
    Ok(ep.connect_lazy())
}

type CpClient = ExecutorsClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

/// Register, then heartbeat; register again whenever the control plane forgot us (e.g. its
/// database was replaced). Sandboxes it has no record of are killed: it holds the truth.
async fn registration_loop(mut client: CpClient, id: String, addr: String, state: Arc<State>) {
    let mut interval = Duration::from_secs(5);
    let mut registered = false;
    loop {
        let st = state.clone();
        let report = match tokio::task::spawn_blocking(move || st.report()).await {
            Ok(r) => r,
            Err(_) => continue,
        };
        if registered {
            match client
                .heartbeat(pb::HeartbeatRequest {
                    id: id.clone(),
                    report: Some(report),
                })
                .await
            {
                Ok(r) => registered = r.into_inner().registered,
                Err(e) => tracing::warn!("heartbeat to the control plane failed: {}", e.message()),
            }
        } else {
            match client
                .register_executor(pb::RegisterExecutorRequest {
                    id: id.clone(),
                    addr: addr.clone(),
                    report: Some(report),
                })
                .await
            {
                Ok(r) => {
                    let r = r.into_inner();
                    registered = true;
                    interval = Duration::from_secs(r.heartbeat_interval_s.clamp(1, 60) as u64);
                    tracing::info!(%id, %addr, "registered with the control plane");
                    for orphan in r.unknown_sandboxes {
                        tracing::warn!(id = %orphan, "the control plane has no record of this sandbox: killing it");
                        let st = state.clone();
                        let _ = tokio::task::spawn_blocking(move || st.kill(&orphan)).await;
                    }
                }
                Err(e) => {
                    tracing::warn!("registering with the control plane failed: {}", e.message())
                }
            }
        }
        tokio::time::sleep(if registered {
            interval
        } else {
            Duration::from_secs(1)
        })
        .await;
    }
}
