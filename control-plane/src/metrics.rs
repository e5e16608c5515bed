//! Prometheus metrics of the control plane, served as text on `/metrics`.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};

pub struct Metrics {
    registry: Registry,
    /// Calls by RPC and gRPC status code.
    pub rpcs: IntCounterVec,
    pub rpc_seconds: HistogramVec,
    /// Spawn-to-ready per child, as its executor measured it.
    pub spawn_to_ready: Histogram,
    /// The control plane's own share of a spawn, by phase (see [`SpawnPhase`]).
    pub spawn_phase_seconds: HistogramVec,
    pub sandboxes_active: IntGauge,
    pub executors_up: IntGauge,
    /// Sandboxes that ended on their own, by cause (out_of_memory, exited).
    pub sandboxes_ended: IntCounterVec,
    /// Ended sandboxes forgotten past the history retention.
    pub sandboxes_forgotten: IntCounter,
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
        let spawn_phase_seconds = HistogramVec::new(
            HistogramOpts::new(
                "tine_spawn_phase_seconds",
                "The control plane's time in each phase of a spawn (executor: call to the child's event; \
                 total: handler start to stream end, for calls that got as far as placing children)",
            )
            // 25 µs to 11.6 s in steps of √2: fine enough to tell which phase holds a tail, and
            // wide enough for a real executor's restore.
            .buckets(prometheus::exponential_buckets(25e-6, std::f64::consts::SQRT_2, 38).expect("buckets")),
            &["phase"],
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
        let sandboxes_forgotten = IntCounter::new(
            "tine_sandboxes_forgotten_total",
            "Ended sandboxes forgotten past the history retention",
        )
        .expect("metric");
        for c in [
            Box::new(rpcs.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(rpc_seconds.clone()),
            Box::new(spawn_to_ready.clone()),
            Box::new(spawn_phase_seconds.clone()),
            Box::new(sandboxes_active.clone()),
            Box::new(executors_up.clone()),
            Box::new(sandboxes_ended.clone()),
            Box::new(sandboxes_forgotten.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        Metrics {
            registry,
            rpcs,
            rpc_seconds,
            spawn_to_ready,
            spawn_phase_seconds,
            sandboxes_active,
            executors_up,
            sandboxes_ended,
            sandboxes_forgotten,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        tine_rpc::metrics::render(&self.registry)
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Count, mean and quantiles of each spawn phase so far. A quantile is the upper bound of
    /// the bucket it falls in (a factor of √2 at most above the true value).
    pub fn spawn_phases(&self) -> Vec<PhaseSummary> {
        self.spawn_phases_since(&PhaseMark::default())
    }

    /// Where each spawn phase's histogram stands now, for [`Metrics::spawn_phases_since`].
    pub fn spawn_phase_mark(&self) -> PhaseMark {
        PhaseMark(
            SpawnPhase::ALL
                .iter()
                .map(|&phase| self.phase_counts(phase).0)
                .collect(),
        )
    }

    /// One phase's histogram as it stands: its counts, and each bucket's upper bound.
    fn phase_counts(&self, phase: SpawnPhase) -> (PhaseCounts, Vec<f64>) {
        use prometheus::core::Metric;
        let m = self
            .spawn_phase_seconds
            .with_label_values(&[phase.name()])
            .metric();
        let h = m.get_histogram();
        let buckets = h.get_bucket();
        let counts = PhaseCounts {
            count: h.get_sample_count(),
            sum_s: h.get_sample_sum(),
            cumulative: buckets.iter().map(|b| b.cumulative_count()).collect(),
        };
        (counts, buckets.iter().map(|b| b.upper_bound()).collect())
    }

    /// [`Metrics::spawn_phases`] counting only the spawns observed after `mark` was taken
    /// (e.g. a load's own, not the set-up's before it).
    pub fn spawn_phases_since(&self, mark: &PhaseMark) -> Vec<PhaseSummary> {
        SpawnPhase::ALL
            .iter()
            .enumerate()
            .map(|(i, &phase)| {
                let (now, bounds) = self.phase_counts(phase);
                let c = now.since(mark.0.get(i));
                // None without samples, or past the last bucket.
                let bound = |q: f64| {
                    let want = (q * c.count as f64).ceil().max(1.0) as u64;
                    bounds
                        .iter()
                        .zip(&c.cumulative)
                        .find(|&(_, &n)| c.count > 0 && n >= want)
                        .map(|(&b, _)| b)
                };
                PhaseSummary {
                    phase,
                    count: c.count,
                    mean_s: if c.count == 0 {
                        0.0
                    } else {
                        c.sum_s / c.count as f64
                    },
                    p50_s: bound(0.5),
                    p90_s: bound(0.9),
                    p99_s: bound(0.99),
                }
            })
            .collect()
    }

    /// Record `d` as time spent in `phase` of a spawn.
    pub fn spawn_phase(&self, phase: SpawnPhase, d: std::time::Duration) {
        self.spawn_phase_seconds
            .with_label_values(&[phase.name()])
            .observe(d.as_secs_f64());
    }
}

/// Records [`SpawnPhase::Total`] when the last clone of it is dropped (held by each task
/// that still sends on a spawn's stream).
pub struct SpawnTimer {
    metrics: std::sync::Arc<Metrics>,
    start: std::time::Instant,
}

impl SpawnTimer {
    pub fn start(
        metrics: std::sync::Arc<Metrics>,
        start: std::time::Instant,
    ) -> std::sync::Arc<SpawnTimer> {
        std::sync::Arc::new(SpawnTimer { metrics, start })
    }
}

impl Drop for SpawnTimer {
    fn drop(&mut self) {
        self.metrics
            .spawn_phase(SpawnPhase::Total, self.start.elapsed());
    }
}

/// The spawn-phase histograms at one moment (see [`Metrics::spawn_phase_mark`]); the default
/// is before any spawn.
#[derive(Clone, Debug, Default)]
pub struct PhaseMark(Vec<PhaseCounts>);

#[derive(Clone, Debug)]
struct PhaseCounts {
    count: u64,
    sum_s: f64,
    /// Each bucket's cumulative count, in the histogram's bucket order.
    cumulative: Vec<u64>,
}

impl PhaseCounts {
    /// What was counted after `before` (a mark's; none: everything).
    fn since(self, before: Option<&PhaseCounts>) -> PhaseCounts {
        let Some(b) = before else { return self };
        PhaseCounts {
            count: self.count - b.count,
            sum_s: self.sum_s - b.sum_s,
            cumulative: self
                .cumulative
                .iter()
                .enumerate()
                .map(|(j, &n)| n - b.cumulative.get(j).copied().unwrap_or(0))
                .collect(),
        }
    }
}

/// One spawn phase's distribution (seconds), from its histogram.
#[derive(Clone, Debug)]
pub struct PhaseSummary {
    pub phase: SpawnPhase,
    pub count: u64,
    pub mean_s: f64,
    /// Bucket upper bounds; None without samples or beyond the last bucket.
    pub p50_s: Option<f64>,
    pub p90_s: Option<f64>,
    pub p99_s: Option<f64>,
}

/// The steps of a spawn on the control plane, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpawnPhase {
    /// Token check and the STARTED audit line.
    Admit,
    /// The read of executors, their loads and the snapshot's copies, and the placement.
    Place,
    /// The new sandbox rows.
    Insert,
    /// From the executor call to this child's event (the executor's work and two gRPC hops).
    Executor,
    /// The update to READY.
    Ready,
    /// The whole call on the control plane: from the handler's start to the end of the
    /// response stream (the last child reported, every executor's stream closed).
    Total,
}

impl SpawnPhase {
    pub const ALL: [SpawnPhase; 6] = [
        SpawnPhase::Admit,
        SpawnPhase::Place,
        SpawnPhase::Insert,
        SpawnPhase::Executor,
        SpawnPhase::Ready,
        SpawnPhase::Total,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SpawnPhase::Admit => "admit",
            SpawnPhase::Place => "place",
            SpawnPhase::Insert => "insert",
            SpawnPhase::Executor => "executor",
            SpawnPhase::Ready => "ready",
            SpawnPhase::Total => "total",
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn phase_quantiles_are_the_bounds_of_their_buckets() {
        let m = Metrics::new();
        // 98 fast inserts and two slow ones: the p99 must land on a slow one's bucket.
        for _ in 0..98 {
            m.spawn_phase(SpawnPhase::Insert, Duration::from_micros(100));
        }
        m.spawn_phase(SpawnPhase::Insert, Duration::from_millis(5));
        m.spawn_phase(SpawnPhase::Insert, Duration::from_millis(5));
        let all = m.spawn_phases();
        assert_eq!(all.len(), SpawnPhase::ALL.len());
        let insert = all.iter().find(|p| p.phase == SpawnPhase::Insert).unwrap();
        assert_eq!(insert.count, 100);
        assert!((100e-6..100e-6 * std::f64::consts::SQRT_2 + 1e-9).contains(&insert.p50_s.unwrap()));
        assert!((5e-3..5e-3 * std::f64::consts::SQRT_2).contains(&insert.p99_s.unwrap()));
        // A real executor's seconds still land in a bucket.
        m.spawn_phase(SpawnPhase::Executor, Duration::from_secs(3));
        let executor = m
            .spawn_phases()
            .into_iter()
            .find(|p| p.phase == SpawnPhase::Executor)
            .unwrap();
        assert!((3.0..3.0 * std::f64::consts::SQRT_2).contains(&executor.p99_s.unwrap()));
        assert!((insert.mean_s - (98.0 * 100e-6 + 2.0 * 5e-3) / 100.0).abs() < 1e-9);
        let admit = all.iter().find(|p| p.phase == SpawnPhase::Admit).unwrap();
        assert_eq!(admit.count, 0);
        assert_eq!(admit.mean_s, 0.0);
        assert_eq!(admit.p50_s, None);
    }

    #[test]
    fn phases_since_a_mark_leave_out_what_came_before() {
        let m = Metrics::new();
        // The set-up: slow places that must not show in the load's figures.
        for _ in 0..50 {
            m.spawn_phase(SpawnPhase::Place, Duration::from_millis(20));
        }
        let mark = m.spawn_phase_mark();
        for _ in 0..100 {
            m.spawn_phase(SpawnPhase::Place, Duration::from_micros(100));
        }
        let since = m.spawn_phases_since(&mark);
        let place = since.iter().find(|p| p.phase == SpawnPhase::Place).unwrap();
        assert_eq!(place.count, 100);
        assert!((place.mean_s - 100e-6).abs() < 1e-9);
        let bucket = 100e-6..100e-6 * std::f64::consts::SQRT_2 + 1e-9;
        assert!(bucket.contains(&place.p99_s.unwrap()), "{:?}", place.p99_s);
        // Everything so far still has the set-up's tail.
        let all = m.spawn_phases();
        let place = all.iter().find(|p| p.phase == SpawnPhase::Place).unwrap();
        assert_eq!(place.count, 150);
        assert!(place.p99_s.unwrap() >= 20e-3);
        // Nothing after the mark: no quantiles, as for a phase never seen.
        let idle = m.spawn_phases_since(&m.spawn_phase_mark());
        assert!(idle.iter().all(|p| p.count == 0 && p.p50_s.is_none()));
    }
}
