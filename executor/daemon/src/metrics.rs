//! The executor's Prometheus metrics: where each spawn's time goes, the worker pool, the
//! VMs running, and why restores fail.

use prometheus::{
    HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
};
use tine_host::SpawnPhases;

pub struct ExecutorMetrics {
    registry: Registry,
    /// Seconds per spawn phase (handoff, restore, running, agent, fixup, total).
    pub spawn_phase: HistogramVec,
    pub pool_idle: IntGauge,
    /// Idle workers the pool keeps now: its floor, or more after bursts found it short.
    pub pool_target: IntGauge,
    pub vms_running: IntGauge,
    /// Children that did not become ready, by reason.
    pub spawn_failures: IntCounterVec,
    /// Wake connections to agents beyond the first, for children that became ready.
    pub agent_retries: IntCounter,
    /// VMMs that exited on their own after they were ready (guest power-off, crash).
    pub vm_exits: IntCounter,
    /// Of those, the ones the kernel killed at their memory limit.
    pub oom_kills: IntCounter,
}

impl ExecutorMetrics {
    pub fn new() -> ExecutorMetrics {
        let registry = Registry::new();
        let spawn_phase = HistogramVec::new(
            HistogramOpts::new(
                "tine_executor_spawn_phase_seconds",
                "Time of each phase of a child's spawn: handoff (record + worker handed the \
                 snapshot), restore (KVM restore in the worker), running (vCPUs started, \
                 reported back), agent (the first agent answer, which also sets the clock, \
                 entropy and identity), fixup (separate clock + reseed calls: agents from \
                 before Wake only), total",
            )
            .buckets(prometheus::exponential_buckets(0.0001, 2.0, 20).expect("buckets")),
            &["phase"],
        )
        .expect("metric");
        let pool_idle = IntGauge::new(
            "tine_executor_pool_idle_workers",
            "Pre-started VMM worker processes waiting for a snapshot",
        )
        .expect("metric");
        let pool_target = IntGauge::new(
            "tine_executor_pool_target_workers",
            "Idle VMM workers the pool keeps now: --pool, grown (up to --pool-max) by the \
             workers spawns had to start when they found it short, back to --pool after a \
             quiet period",
        )
        .expect("metric");
        let vms_running =
            IntGauge::new("tine_executor_vms_running", "VMs this executor runs").expect("metric");
        let spawn_failures = IntCounterVec::new(
            Opts::new(
                "tine_executor_spawn_failures_total",
                "Children that failed to restore or become ready, by reason",
            ),
            &["reason"],
        )
        .expect("metric");
        let agent_retries = IntCounter::new(
            "tine_executor_spawn_agent_retries_total",
            "Wake connections to a child's agent beyond the first before it answered, for \
             children that became ready (a guest not yet listening, or slow to answer)",
        )
        .expect("metric");
        let vm_exits = IntCounter::new(
            "tine_executor_vm_exits_total",
            "VMMs that exited on their own after their child was ready",
        )
        .expect("metric");
        let oom_kills = IntCounter::new(
            "tine_executor_oom_kills_total",
            "Children whose VMM the kernel killed at their cgroup's memory limit",
        )
        .expect("metric");
        for c in [
            Box::new(spawn_phase.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(pool_idle.clone()),
            Box::new(pool_target.clone()),
            Box::new(vms_running.clone()),
            Box::new(spawn_failures.clone()),
            Box::new(agent_retries.clone()),
            Box::new(vm_exits.clone()),
            Box::new(oom_kills.clone()),
        ] {
            registry.register(c).expect("unique metric names");
        }
        ExecutorMetrics {
            registry,
            spawn_phase,
            pool_idle,
            pool_target,
            vms_running,
            spawn_failures,
            agent_retries,
            vm_exits,
            oom_kills,
        }
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    pub fn observe(&self, p: &SpawnPhases) {
        for (name, d) in p.named() {
            self.spawn_phase
                .with_label_values(&[name])
                .observe(d.as_secs_f64());
        }
        self.agent_retries
            .inc_by(u64::from(p.agent_attempts.saturating_sub(1)));
    }
}

impl Default for ExecutorMetrics {
    fn default() -> Self {
        ExecutorMetrics::new()
    }
}
