//! gRPC clients for the executors' internal API, one lazily connected channel per address,
//! each call carrying the cluster's executor token.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tine_proto::executor::v1::executor_client::ExecutorClient;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Status};

/// Adds `authorization: Bearer <token>` to every request.
#[derive(Clone)]
pub struct Bearer(Option<AsciiMetadataValue>);

impl Bearer {
    pub fn new(token: Option<&str>) -> Result<Bearer, String> {
        token
            .map(|t| {
                format!("Bearer {t}")
                    .parse::<AsciiMetadataValue>()
                    .map_err(|_| "token is not printable ASCII".to_string())
            })
            .transpose()
            .map(Bearer)
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        crate::telemetry::inject_current(req.metadata_mut());
        Ok(req)
    }
}

pub type ExecClient = ExecutorClient<InterceptedService<Channel, Bearer>>;

pub struct ExecutorPool {
    bearer: Bearer,
    tls: Option<ClientTlsConfig>,
    channels: Mutex<HashMap<String, Channel>>,
}

impl ExecutorPool {
    pub fn new(token: Option<&str>, tls: Option<ClientTlsConfig>) -> Result<ExecutorPool, String> {
        Ok(ExecutorPool {
            bearer: Bearer::new(token)?,
            tls,
            channels: Mutex::new(HashMap::new()),
        })
    }

    pub fn client(&self, addr: &str) -> Result<ExecClient, Status> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        let channel = match channels.get(addr) {
            Some(c) => c.clone(),
            None => {
                let mut ep = Endpoint::from_shared(addr.to_string())
                    .map_err(|e| Status::internal(format!("executor address {addr:?}: {e}")))?
                    .connect_timeout(Duration::from_secs(5))
                    .tcp_nodelay(true)
                    .http2_keep_alive_interval(Duration::from_secs(30));
                if addr.starts_with("https://") {
                    let tls = self.tls.clone().ok_or_else(|| {
                        Status::failed_precondition(format!(
                            "executor {addr} speaks TLS but the control plane has no CA for executors (--executor-ca)"
                        ))
                    })?;
                    ep = ep
                        .tls_config(tls)
                        .map_err(|e| Status::internal(format!("TLS for {addr}: {e}")))?;
                }
                let c = ep.connect_lazy();
                channels.insert(addr.to_string(), c.clone());
                c
            }
        };
        Ok(
            ExecutorClient::with_interceptor(channel, self.bearer.clone())
                .max_decoding_message_size(crate::validate::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(crate::validate::MAX_MESSAGE_BYTES),
        )
    }
}
