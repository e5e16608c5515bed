//! gRPC clients for the executors' internal API, one lazily made connection per address
//! ([`Hop`]), each call carrying the executor's own token (`executor:ID` in the tokens file) or else the
//! cluster's shared executor token.

use std::collections::HashMap;
use std::sync::Mutex;

use tine_proto::executor::v1::executor_client::ExecutorClient;
use tine_rpc::auth::Bearer;
use tine_rpc::limits::MAX_MESSAGE_BYTES;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::Status;

use crate::hop::{Hop, Plain};

pub type ExecClient = ExecutorClient<InterceptedService<Hop, Bearer>>;

pub struct ExecutorPool {
    bearer: Bearer,
    /// Executors with tokens of their own, by id.
    own: HashMap<String, Bearer>,
    tls: Option<ClientTlsConfig>,
    hops: Mutex<HashMap<String, Hop>>,
}

impl ExecutorPool {
    /// `token`: the shared executor token; `own`: tokens of single executors, by id.
    pub fn new(
        token: Option<&str>,
        own: &HashMap<String, String>,
        tls: Option<ClientTlsConfig>,
    ) -> Result<ExecutorPool, String> {
        Ok(ExecutorPool {
            bearer: Bearer::new(token).map_err(|e| e.to_string())?,
            own: own
                .iter()
                .map(|(id, t)| Ok((id.clone(), Bearer::new(Some(t))?)))
                .collect::<Result<_, tine_rpc::auth::TokenError>>()
                .map_err(|e| e.to_string())?,
            tls,
            hops: Mutex::new(HashMap::new()),
        })
    }

    /// A client for executor `id` at `addr`, presenting that executor's token.
    pub fn client(&self, id: &str, addr: &str) -> Result<ExecClient, Status> {
        let mut hops = self.hops.lock().unwrap_or_else(|p| p.into_inner());
        let hop = match hops.get(addr) {
            Some(h) => h.clone(),
            None => {
                let plain = addr.parse().ok().and_then(|u| Plain::new(&u).ok());
                let h = match plain {
                    Some(p) => Hop::Plain(p),
                    None => Hop::Channel(self.channel(addr)?),
                };
                hops.insert(addr.to_string(), h.clone());
                h
            }
        };
        Ok(
            ExecutorClient::with_interceptor(hop, self.own.get(id).unwrap_or(&self.bearer).clone())
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
    }

    /// tonic's lazily connected channel to `addr` (`https://`, with the executors' CA).
    fn channel(&self, addr: &str) -> Result<Channel, Status> {
        let mut ep = Endpoint::from_shared(addr.to_string())
            .map_err(|e| Status::internal(format!("executor address {addr:?}: {e}")))?
            .connect_timeout(crate::hop::CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(crate::hop::KEEP_ALIVE);
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
        Ok(ep.connect_lazy())
    }
}
