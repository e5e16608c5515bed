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

/// Reads a Spawn's events to the end and returns the ids of the children that came up; failed
/// children and a broken stream are counted in `st` as `{what}-child` and `{what}-stream`.
async fn ready_ids(
    mut events: tonic::Streaming<pb::SpawnEvent>,
    st: &mut Stats,
    what: &str,
) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(ev) = events.next().await {
        match ev {
            Ok(pb::SpawnEvent {
                result: Some(pb::spawn_event::Result::Ready(sb)),
                ..
            }) => ids.push(sb.id),
            Ok(pb::SpawnEvent {
                result: Some(pb::spawn_event::Result::Failed(f)),
                ..
            }) => st.error(&format!("{what}-child"), &f.code),
            Ok(_) => {}
            Err(e) => st.error(&format!("{what}-stream"), code_name(e.code())),
        }
    }
    ids
}

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
        let ids = match c.spawn(req).await {
            Ok(resp) => {
                let ids = ready_ids(resp.into_inner(), &mut st, "spawn").await;
                st.record("spawn", t.elapsed());
                ids
            }
            Err(e) => {
                st.error("spawn", code_name(e.code()));
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
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

/// `connections` HTTP/2 connections to the control plane, and the bearer for its calls.
async fn connect(load: &Load) -> anyhow::Result<(Vec<Channel>, Bearer)> {
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
    Ok((channels, bearer))
}

/// Children per spawn call while standing children up (the API's limit per call is larger;
/// smaller calls keep each one's executor stream short).
const STANDING_PER_CALL: u32 = 100;
/// Spawn and kill calls in flight at once while standing children up or down.
const STANDING_IN_FLIGHT: usize = 8;

/// Spawn `n` children that stay live while the load runs (so the control plane's records hold
/// as many live sandboxes as a busy fleet's), before the clock starts; returns their ids.
/// `lifetime` is asked as their sandbox timeout, so they outlive the run but not by much if
/// the load is cut short. Progress goes to stderr.
pub async fn stand_up(load: &Load, n: u32, lifetime: Duration) -> anyhow::Result<Vec<String>> {
    let (channels, bearer) = connect(load).await?;
    let calls: Vec<u32> = (0..n.div_ceil(STANDING_PER_CALL))
        .map(|i| (n - i * STANDING_PER_CALL).min(STANDING_PER_CALL))
        .collect();
    let timeout_s = u32::try_from(lifetime.as_secs().max(1)).unwrap_or(u32::MAX);
    let mut ids = Vec::with_capacity(n as usize);
    let mut errors = Stats::default();
    let started = Instant::now();
    let mut results = futures::stream::iter(calls.into_iter().enumerate().map(|(i, count)| {
        let mut c =
            SandboxesClient::with_interceptor(channels[i % channels.len()].clone(), bearer.clone());
        let req = pb::SpawnRequest {
            tag: load.tag.clone(),
            count,
            sandbox_timeout_s: timeout_s,
            ..Default::default()
        };
        async move {
            let mut st = Stats::default();
            let ids = match c.spawn(req).await {
                Ok(resp) => ready_ids(resp.into_inner(), &mut st, "standing").await,
                Err(e) => {
                    st.error("standing-spawn", code_name(e.code()));
                    Vec::new()
                }
            };
            (ids, st)
        }
    }))
    .buffer_unordered(STANDING_IN_FLIGHT);
    let mut last_note = Instant::now();
    while let Some((got, st)) = results.next().await {
        ids.extend(got);
        errors.merge(st);
        if last_note.elapsed() >= Duration::from_secs(2) {
            eprintln!(
                "tine-loadtest: standing children: {} of {n} ready",
                ids.len()
            );
            last_note = Instant::now();
        }
    }
    if !errors.errors.is_empty() || ids.len() != n as usize {
        anyhow::bail!(
            "standing children: {} of {n} ready; failures: {:?}",
            ids.len(),
            errors.errors
        );
    }
    eprintln!(
        "tine-loadtest: standing children: {n} ready in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(ids)
}

/// Kill the standing children; returns how many kills failed.
pub async fn stand_down(load: &Load, ids: Vec<String>) -> anyhow::Result<usize> {
    let (channels, bearer) = connect(load).await?;
    let failed = futures::stream::iter(ids.into_iter().enumerate().map(|(i, id)| {
        let mut c =
            SandboxesClient::with_interceptor(channels[i % channels.len()].clone(), bearer.clone());
        async move { c.kill_sandbox(pb::KillSandboxRequest { id }).await.is_err() }
    }))
    .buffer_unordered(STANDING_IN_FLIGHT * 4)
    .filter(|failed| futures::future::ready(*failed))
    .count()
    .await;
    Ok(failed)
}

/// Run the load; returns the merged statistics and the wall time.
pub async fn run(load: Load) -> anyhow::Result<(Stats, Duration)> {
    let (channels, bearer) = connect(&load).await?;
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
