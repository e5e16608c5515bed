//! The load: each client loops spawn (n children) → exec in each → kill each, until the
//! deadline, timing every call from the client's side.

use std::time::{Duration, Instant};

use futures::StreamExt;
use tine_proto::v1 as pb;
use tine_proto::v1::sandboxes_client::SandboxesClient;
use tine_rpc::auth::Bearer;
use tine_rpc::status::code_name;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::report::Stats;

#[derive(Clone, Debug)]
pub struct Load {
    pub addr: String,
    pub token: Option<String>,
    pub tag: String,
    pub clients: usize,
    /// HTTP/2 connections the clients share (round robin).
    pub connections: usize,
    pub duration: Duration,
    pub children_per_spawn: u32,
    pub execs_per_child: u32,
    /// Loops per second per client (0: back to back, a closed loop that measures saturation).
    pub rate_per_client: f64,
}

type Client = SandboxesClient<InterceptedService<Channel, Bearer>>;

async fn one_client(mut c: Client, load: Load, deadline: Instant) -> Stats {
    let mut st = Stats::default();
    let period =
        (load.rate_per_client > 0.0).then(|| Duration::from_secs_f64(1.0 / load.rate_per_client));
    // Clients start spread over one period so they do not arrive in lockstep.
    let mut next = Instant::now() + period.map_or(Duration::ZERO, |p| p.mul_f64(fastrand_unit()));
    while Instant::now() < deadline {
        if let Some(p) = period {
            tokio::time::sleep_until(next.into()).await;
            next += p;
        }
        let t = Instant::now();
        let req = pb::SpawnRequest {
            tag: load.tag.clone(),
            count: load.children_per_spawn,
            ..Default::default()
        };
        let mut ids = Vec::new();
        match c.spawn(req).await {
            Ok(resp) => {
                let mut s = resp.into_inner();
                while let Some(ev) = s.next().await {
                    match ev {
                        Ok(pb::SpawnEvent {
                            result: Some(pb::spawn_event::Result::Ready(sb)),
                            ..
                        }) => ids.push(sb.id),
                        Ok(pb::SpawnEvent {
                            result: Some(pb::spawn_event::Result::Failed(f)),
                            ..
                        }) => st.error("spawn-child", &f.code),
                        Ok(_) => {}
                        Err(e) => st.error("spawn-stream", code_name(e.code())),
                    }
                }
                st.record("spawn", t.elapsed());
            }
            Err(e) => {
                st.error("spawn", code_name(e.code()));
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        }
        for id in &ids {
            for _ in 0..load.execs_per_child {
                let t = Instant::now();
                let req = pb::ExecRequest {
                    sandbox_id: id.clone(),
                    argv: vec!["true".into()],
                    ..Default::default()
                };
                match c.exec(req).await {
                    Ok(resp) => {
                        let mut s = resp.into_inner();
                        while s.next().await.is_some() {}
                        st.record("exec", t.elapsed());
                    }
                    Err(e) => st.error("exec", code_name(e.code())),
                }
            }
            let t = Instant::now();
            match c
                .kill_sandbox(pb::KillSandboxRequest { id: id.clone() })
                .await
            {
                Ok(_) => st.record("kill", t.elapsed()),
                Err(e) => st.error("kill", code_name(e.code())),
            }
        }
    }
    st
}

/// A number in [0, 1) that differs per call (no RNG dependency needed for jitter).
fn fastrand_unit() -> f64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    (h.finish() >> 11) as f64 / (1u64 << 53) as f64
}

/// Run the load; returns the merged statistics and the wall time.
pub async fn run(load: Load) -> anyhow::Result<(Stats, Duration)> {
    let bearer = Bearer::new(load.token.as_deref()).map_err(|e| anyhow::anyhow!(e))?;
    let mut channels = Vec::new();
    for _ in 0..load.connections.max(1) {
        channels.push(
            Endpoint::from_shared(load.addr.clone())?
                .tcp_nodelay(true)
                .connect()
                .await?,
        );
    }
    let start = Instant::now();
    let deadline = start + load.duration;
    let mut tasks = Vec::new();
    for i in 0..load.clients {
        let c =
            SandboxesClient::with_interceptor(channels[i % channels.len()].clone(), bearer.clone());
        tasks.push(tokio::spawn(one_client(c, load.clone(), deadline)));
    }
    let mut all = Stats::default();
    for t in tasks {
        all.merge(t.await?);
    }
    Ok((all, start.elapsed()))
}
