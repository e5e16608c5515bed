//! Prometheus metrics of the control plane, served as text on `/metrics`.

use prometheus::{Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry};

pub struct Metrics {
    registry: Registry,
    /// Calls by RPC and gRPC status code.
    pub rpcs: IntCounterVec,
    pub rpc_seconds: HistogramVec,
    /// Spawn-to-ready per child, as its executor measured it.
    pub spawn_to_ready: Histogram,
    pub sandboxes_active: IntGauge,
    pub executors_up: IntGauge,
    /// Sandboxes that ended on their own, by cause (out_of_memory, exited).
    pub sandboxes_ended: IntCounterVec,
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let rpcs = IntCounterVec::new(
            Opts::new("tine_rpcs_total", "gRPC calls by method and status code"),
            &["rpc", "code"],
        )
        .expect("metric");
        let rpc_seconds = HistogramVec::new(
            HistogramOpts::new(
                "tine_rpc_duration_seconds",
                "Time to the response (streams: to the first message)",
            )
            .buckets(prometheus::exponential_buckets(0.0001, 4.0, 10).expect("buckets")),
            &["rpc"],
        )
        .expect("metric");
        let spawn_to_ready = Histogram::with_opts(
            HistogramOpts::new(
                "tine_spawn_to_ready_seconds",
                "Child spawn to agent ready, measured on the executor",
            )
            .buckets(prometheus::exponential_buckets(0.001, 2.0, 16).expect("buckets")),
        )
        .expect("metric");
        let sandboxes_active =
            IntGauge::new("tine_sandboxes_active", "Sandboxes starting or ready").expect("metric");
        let executors_up = IntGauge::new(
            "tine_executors_up",
            "Executors with a recent heartbeat (draining ones included)",
        )
        .expect("metric");
        let sandboxes_ended = IntCounterVec::new(
            Opts::new(
                "tine_sandboxes_ended_total",
                "Sandboxes that ended on their own, by cause (out_of_memory, exited)",
            ),
            &["cause"],
        )
        .expect("metric");
        for c in [
            Box::new(rpcs.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(rpc_seconds.clone()),
            Box::new(spawn_to_ready.clone()),
            Box::new(sandboxes_active.clone()),
            Box::new(executors_up.clone()),
            Box::new(sandboxes_ended.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        Metrics {
            registry,
            rpcs,
            rpc_seconds,
            spawn_to_ready,
            sandboxes_active,
            executors_up,
            sandboxes_ended,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        tine_rpc::metrics::render(&self.registry)
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
