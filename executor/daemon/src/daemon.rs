//! Running the executor daemon: serve the executor API, keep the VMM worker pool warm, reap
//! exited children, and register + heartbeat with the control plane.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use tine_host::{Host, HostConfig};
use tine_proto::executor::v1::executor_server::ExecutorServer;
use tine_proto::v1 as pb;
use tine_proto::v1::executors_client::ExecutorsClient;
use tine_rpc::auth::{executor_secret, Bearer, Principal, Role, TokenSet};
use tine_rpc::gate::{GateLayer, Gatekeeper, Refused, Verdict};
use tine_rpc::limits::MAX_MESSAGE_BYTES;
use tine_rpc::tls::TlsFiles;
use tine_rpc::ExecutorId;
use tokio::sync::oneshot;
use tonic::transport::Server;

use crate::service::{ExecutorService, State};

pub struct ExecutorConfig {
    pub id: ExecutorId,
    pub listen: SocketAddr,
    /// How the control plane reaches this executor (default: http://<listen>).
    pub advertise: Option<String>,
    /// Accepted from the control plane and presented to it (role "executor").
    pub token: Option<String>,
    /// The control plane to register with (http(s)://host:port); None: standalone.
    pub control_plane: Option<String>,
    pub control_plane_ca: Option<PathBuf>,
    pub tls: Option<TlsFiles>,
    /// The VMs of this host: data directory, worker executable, limits. Its owner must be
    /// this executor (`Owner::Executor(id)`), so a restart re-adopts exactly its VMs.
    pub host: HostConfig,
    /// Where `/metrics` is served (None: not served).
    pub metrics_listen: Option<SocketAddr>,
    pub allow_plaintext_remote: bool,
    /// Refuse VM work with this message (e.g. PVM hosts).
    pub vm_refusal: Option<String>,
}

/// The executor's gate: every call of the executor API must carry the control plane's token
/// (when one is configured), checked on its headers before its body is read.
struct Keeper {
    tokens: Option<TokenSet>,
}

const GATED_PREFIX: &str = "/tine.executor.v1.";

impl Gatekeeper for Keeper {
    fn admit(&self, path: &str, headers: &http::HeaderMap) -> Verdict {
        if !path.starts_with(GATED_PREFIX) {
            return Verdict::Open;
        }
        let principal = match &self.tokens {
            Some(t) => match t.authenticate_headers(headers) {
                Ok(p) => p,
                Err(status) => {
                    return Verdict::Refuse {
                        principal: None,
                        status,
                    }
                }
            },
            None => Principal {
                name: "anonymous".into(),
                role: Role::Executor,
            },
        };
        Verdict::Admit {
            principal,
            body_limit: MAX_MESSAGE_BYTES,
        }
    }

    fn refused(&self, call: Refused<'_>) {
        tracing::warn!(
            path = call.path,
            peer = ?call.peer,
            code = tine_rpc::status::code_name(call.status.code()),
            "refused before the handler: {}",
            call.status.message()
        );
    }
}

pub struct RunningExecutor {
    pub addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
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
            tokio::task::spawn_blocking(move || st.host.kill_all()).await?;
        }
        Ok(())
    }
}

pub async fn start(cfg: ExecutorConfig) -> Result<RunningExecutor> {
    anyhow::ensure!(
        cfg.host.owner == tine_host::Owner::executor(&cfg.id),
        "the host's owner must be executor {}",
        cfg.id
    );
    tine_rpc::tls::check_listen(
        cfg.listen,
        cfg.token.is_some(),
        cfg.tls.is_some(),
        cfg.allow_plaintext_remote,
    )?;
    let tokens = cfg.token.as_deref().map(executor_secret).transpose()?;
    let host_cfg = cfg.host.clone();
    let host = tokio::task::spawn_blocking(move || Host::open_exclusive(host_cfg))
        .await?
        .context("opening the host's data directory")?;
    // Said once, here, rather than by every spawn.
    let host = match cfg.vm_refusal {
        None => tokio::task::spawn_blocking(move || host.check_confinement().map(|()| host))
            .await?
            .context("checking that VMMs can be confined")?,
        Some(_) => host,
    };
    let state = State::new(cfg.id.clone(), host, cfg.vm_refusal.clone());
    if cfg.vm_refusal.is_none() {
        let st = state.clone();
        tokio::task::spawn_blocking(move || st.host.fill_pool());
    }

    let svc = ExecutorServer::new(ExecutorService {
        state: state.clone(),
    })
    .max_decoding_message_size(MAX_MESSAGE_BYTES)
    .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let connections = tine_rpc::conn::Connections::default();
    let mut builder = connections.server(
        Server::builder().trace_fn(|req| tine_rpc::telemetry::request_span(req, "executor")),
    );
    if let Some(tls) = &cfg.tls {
        builder = builder.tls_config(tls.server_config()?)?;
    }
    let router = builder
        .layer(GateLayer::new(Arc::new(Keeper { tokens })))
        .add_service(svc);
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
        let (bound, t) = tine_rpc::metrics::serve(m, state.metrics.registry().clone())
            .await
            .with_context(|| format!("binding the metrics listener {m}"))?;
        metrics_addr = Some(bound);
        background.push(t);
    }
    let st = state.clone();
    background.push(tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let s = st.clone();
            let _ = tokio::task::spawn_blocking(move || s.reap()).await;
        }
    }));
    if let Some(store) = &cfg.host.store {
        // Layers of deleted snapshots leave the store and this host's cache once older than
        // the grace period; collecting that often is enough.
        let every = store.gc_grace.max(Duration::from_secs(60));
        let st = state.clone();
        background.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let s = st.clone();
                match tokio::task::spawn_blocking(move || s.host.collect_garbage()).await {
                    Ok(Err(e)) => tracing::warn!("garbage collection: {e}"),
                    Err(e) => tracing::warn!("garbage collection task: {e}"),
                    Ok(Ok(_)) => {}
                }
            }
        }));
    }
    if let Some(cp) = &cfg.control_plane {
        let scheme = if cfg.tls.is_some() { "https" } else { "http" };
        let advertise = cfg
            .advertise
            .clone()
            .unwrap_or_else(|| format!("{scheme}://{addr}"));
        let channel = tine_rpc::tls::channel(cp, cfg.control_plane_ca.as_deref())
            .context("the control plane")?;
        let client = ExecutorsClient::with_interceptor(channel, Bearer::new(cfg.token.as_deref())?);
        background.push(tokio::spawn(registration_loop(
            client,
            cfg.id.to_string(),
            advertise,
            state.clone(),
        )));
    }
    tracing::info!(%addr, id = %cfg.id, "executor listening");
    Ok(RunningExecutor {
        addr,
        metrics_addr,
        state,
        shutdown: Some(tx),
        task,
        background,
    })
}

type CpClient = ExecutorsClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

/// How long one registration or heartbeat may take: a call that hangs must not stall the loop.
const CP_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// How soon a failed registration or heartbeat is tried again: an executor is back within a
/// second of its control plane's return, not a heartbeat period later (three missed periods
/// mark it down). No longer than any period (at least 1 s).
const CP_RETRY: Duration = Duration::from_secs(1);

/// Register, then heartbeat; register again whenever the control plane forgot us (e.g. its
/// database was replaced). Sandboxes it has no record of are killed: it holds the truth.
async fn registration_loop(mut client: CpClient, id: String, addr: String, state: Arc<State>) {
    let mut interval = Duration::from_secs(5);
    let mut registered = false;
    let mut failed = 0u32;
    loop {
        let st = state.clone();
        let report = match tokio::task::spawn_blocking(move || st.report()).await {
            Ok(r) => r,
            Err(_) => continue,
        };
        let answered = if registered {
            let call = client.heartbeat(pb::HeartbeatRequest {
                id: id.clone(),
                report: Some(report),
            });
            match cp_call("heartbeat to", failed, call).await {
                Some(r) => {
                    registered = r.registered;
                    kill_orphans(&state, r.unknown_sandboxes).await;
                    true
                }
                None => false,
            }
        } else {
            let call = client.register_executor(pb::RegisterExecutorRequest {
                id: id.clone(),
                addr: addr.clone(),
                report: Some(report),
            });
            match cp_call("registering with", failed, call).await {
                Some(r) => {
                    registered = true;
                    interval = Duration::from_secs(r.heartbeat_interval_s.clamp(1, 60) as u64);
                    tracing::info!(%id, %addr, "registered with the control plane");
                    kill_orphans(&state, r.unknown_sandboxes).await;
                    true
                }
                None => false,
            }
        };
        if answered {
            if failed > 0 {
                tracing::info!(failed, "the control plane answers again");
            }
            failed = 0;
        } else {
            failed += 1;
        }
        tokio::time::sleep(if registered && answered {
            interval
        } else {
            CP_RETRY
        })
        .await;
    }
}

/// One call to the control plane, bounded by [`CP_CALL_TIMEOUT`]; None when it failed (logged
/// when it is the first failure of a streak, or every 60th: `failed` before this one).
async fn cp_call<T>(
    what: &str,
    failed: u32,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Option<T> {
    let why = match tokio::time::timeout(CP_CALL_TIMEOUT, call).await {
        Ok(Ok(r)) => return Some(r.into_inner()),
        Ok(Err(e)) => e.message().to_string(),
        Err(_) => format!("no answer in {CP_CALL_TIMEOUT:?}"),
    };
    if failed.is_multiple_of(60) {
        tracing::warn!(failed, "{what} the control plane failed: {why}");
    }
    None
}

/// Kill the sandboxes the control plane has no live record of (it answers them to a
/// registration or a heartbeat): a child nobody can reach or account for must not run on.
async fn kill_orphans(state: &Arc<State>, ids: Vec<String>) {
    for orphan in ids {
        tracing::warn!(id = %orphan, "the control plane has no record of this sandbox: killing it");
        let Ok(orphan) = tine_rpc::SandboxId::parse(orphan) else {
            continue;
        };
        let st = state.clone();
        let _ = tokio::task::spawn_blocking(move || st.host.kill(&orphan)).await;
    }
}
