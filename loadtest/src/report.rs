//! Latency histograms per operation and their table / JSON rendering.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use tine_control_plane::metrics::PhaseSummary;

#[derive(Default)]
pub struct Stats {
    /// Microseconds, 1 µs to 60 s at 3 significant digits.
    pub hist: BTreeMap<&'static str, Histogram<u64>>,
    pub errors: BTreeMap<String, u64>,
}

impl Stats {
    pub fn record(&mut self, op: &'static str, d: Duration) {
        let h = self
            .hist
            .entry(op)
            .or_insert_with(|| Histogram::new_with_bounds(1, 60_000_000, 3).expect("bounds"));
        let _ = h.record((d.as_micros() as u64).clamp(1, 60_000_000));
    }

    pub fn error(&mut self, op: &str, code: &str) {
        *self.errors.entry(format!("{op}:{code}")).or_default() += 1;
    }

    pub fn merge(&mut self, other: Stats) {
        for (op, h) in other.hist {
            match self.hist.get_mut(op) {
                Some(mine) => mine.add(&h).expect("same bounds"),
                None => {
                    self.hist.insert(op, h);
                }
            }
        }
        for (k, v) in other.errors {
            *self.errors.entry(k).or_default() += v;
        }
    }

    fn ms(v: u64) -> f64 {
        v as f64 / 1000.0
    }

    pub fn table(&self, wall: Duration) -> String {
        let mut out = format!(
            "{:<8} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
            "op", "count", "per s", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms"
        );
        for (op, h) in &self.hist {
            out += &format!(
                "{:<8} {:>9} {:>10.0} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}\n",
                op,
                h.len(),
                h.len() as f64 / wall.as_secs_f64(),
                Self::ms(h.value_at_quantile(0.5)),
                Self::ms(h.value_at_quantile(0.9)),
                Self::ms(h.value_at_quantile(0.99)),
                Self::ms(h.value_at_quantile(0.999)),
                Self::ms(h.max()),
            );
        }
        for (k, v) in &self.errors {
            out += &format!("errors   {k}: {v}\n");
        }
        out
    }

    pub fn json(&self, wall: Duration, params: serde_json::Value) -> serde_json::Value {
        let ops: serde_json::Map<String, serde_json::Value> = self
            .hist
            .iter()
            .map(|(op, h)| {
                (
                    op.to_string(),
                    serde_json::json!({
                        "count": h.len(),
                        "per_second": h.len() as f64 / wall.as_secs_f64(),
                        "p50_ms": Self::ms(h.value_at_quantile(0.5)),
                        "p90_ms": Self::ms(h.value_at_quantile(0.9)),
                        "p99_ms": Self::ms(h.value_at_quantile(0.99)),
                        "p999_ms": Self::ms(h.value_at_quantile(0.999)),
                        "max_ms": Self::ms(h.max()),
                    }),
                )
            })
            .collect();
        serde_json::json!({
            "params": params,
            "wall_seconds": wall.as_secs_f64(),
            "ops": ops,
            "errors": self.errors,
        })
    }
}

/// The control plane's side of each spawn, by phase. Quantiles are bucket upper bounds
/// (within a factor of √2), the mean is exact.
pub fn phase_table(phases: &[PhaseSummary]) -> String {
    let mut out = format!(
        "\nspawn phases inside the control plane (quantiles: histogram bucket upper bounds, within x1.41)\n{:<9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
        "phase", "count", "mean ms", "p50 ≤ms", "p90 ≤ms", "p99 ≤ms"
    );
    for p in phases {
        let ms = |q: Option<f64>| q.map_or_else(|| "-".to_string(), |s| format!("{:.3}", s * 1e3));
        out += &format!(
            "{:<9} {:>9} {:>9.3} {:>9} {:>9} {:>9}\n",
            p.phase.name(),
            p.count,
            p.mean_s * 1e3,
            ms(p.p50_s),
            ms(p.p90_s),
            ms(p.p99_s)
        );
    }
    out
}

pub fn phase_json(phases: &[PhaseSummary]) -> serde_json::Value {
    phases
        .iter()
        .map(|p| {
            (
                p.phase.name().to_string(),
                serde_json::json!({
                    "count": p.count,
                    "mean_ms": p.mean_s * 1e3,
                    "p50_le_ms": p.p50_s.map(|s| s * 1e3),
                    "p90_le_ms": p.p90_s.map(|s| s * 1e3),
                    "p99_le_ms": p.p99_s.map(|s| s * 1e3),
                }),
            )
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}
