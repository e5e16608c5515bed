//! Agent latency benchmark: ping, exec round trip, warm eval, and a cold `python3 -c` run
//! through the agent in the same VM, for comparison. Figures are printed, never asserted.

use std::time::{Duration, Instant};

use anyhow::Context;

use crate::cli::AgentTarget;
use crate::client::AgentClient;

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub target: AgentTarget,
    /// Samples per measurement (the cold interpreter gets at most 20).
    #[arg(long, default_value_t = 50)]
    pub iterations: usize,
    /// Module the cold and warm Python runs import.
    #[arg(long, default_value = "numpy")]
    pub module: String,
}

fn measure(n: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<Vec<Duration>> {
    f()?; // warm caches and connections once, unmeasured
    let mut samples = (0..n)
        .map(|_| {
            let t = Instant::now();
            f().map(|_| t.elapsed())
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    samples.sort();
    Ok(samples)
}

fn pct(s: &[Duration], p: f64) -> f64 {
    let i = ((s.len() - 1) as f64 * p).round() as usize;
    s[i].as_secs_f64() * 1e3
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.iterations > 0, "--iterations must be at least 1");
    let client: AgentClient = args.target.client()?;
    client
        .wait_ready(Duration::from_secs(60))
        .context("agent not ready")?;
    let m = &args.module;
    let eval_code = format!("import {m}; {m}.__name__");
    let cold_code = format!("import {m}; print({m}.__name__)");
    let n = args.iterations;

    let rows: Vec<(String, Vec<Duration>)> = vec![
        ("ping".into(), measure(n, || Ok(client.ping().map(drop)?))?),
        (
            "exec `true`".into(),
            measure(n, || {
                let (st, _, _) = client.exec_output(&["true"], &Default::default())?;
                anyhow::ensure!(st.success(), "true failed: {st:?}");
                Ok(())
            })?,
        ),
        (
            format!("warm eval `{eval_code}`"),
            measure(n, || {
                let r = client.eval(&eval_code)?;
                anyhow::ensure!(r.error.is_none(), "eval raised: {:?}", r.error);
                Ok(())
            })?,
        ),
        (
            format!("cold exec `python3 -c '{cold_code}'`"),
            measure(n.min(20), || {
                let (st, _, err) =
                    client.exec_output(&["python3", "-c", &cold_code], &Default::default())?;
                anyhow::ensure!(st.success(), "{}", String::from_utf8_lossy(&err));
                Ok(())
            })?,
        ),
    ];

    println!("agent latency: wall time per call from the host client, each call on a new vsock stream; samples sorted, p50/p90 by rank");
    println!(
        "{:<60} {:>6} {:>10} {:>10}",
        "operation", "n", "p50 ms", "p90 ms"
    );
    for (name, s) in &rows {
        println!(
            "{name:<60} {:>6} {:>10.3} {:>10.3}",
            s.len(),
            pct(s, 0.5),
            pct(s, 0.9)
        );
    }
    let warm = pct(&rows[2].1, 0.5);
    let cold = pct(&rows[3].1, 0.5);
    println!(
        "warm eval is {:.0}x faster than a cold interpreter (p50 vs p50, same run)",
        cold / warm
    );
    Ok(())
}
