//! `tine bench branch`: how long a branch keeps a sandbox paused (DIFF and FULL, after the
//! sandbox wrote N MiB since its fork) beside a bare pause + resume of the same VM (the floor),
//! how long the call takes, what repeated branches of one sandbox cost (each a diff over the
//! one before, the sandbox rebased onto it), and what spawning from a chain of diffs costs at
//! depth 0..D.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use tine_host::{BranchKind, Host, Limits, Owner, Readiness};
use tine_proto::names::{SandboxId, Tag};

use crate::bench_fetch::{first_child, p50};

#[derive(clap::Args)]
pub struct BranchBench {
    /// Snapshot tag on this host (made with `tine snapshot`, e.g. `--mem-mib 1024`).
    #[arg(long)]
    tag: Tag,
    /// Branches per mode and size (and spawns per depth).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// MiB each sandbox writes after its fork and before it is branched (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "16,128")]
    write_mib: Vec<u64>,
    /// Deepest chain of diffs to spawn from.
    #[arg(long, default_value_t = 5)]
    depth: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Make the sandbox write `mib` MiB of fresh (non-zero) memory.
fn write_mib(host: &Host, id: &SandboxId, name: &str, mib: u64) -> Result<()> {
    let sock = host.vm_dir(id)?.join("vsock.sock");
    let out = tine_host::ready::agent(&sock)
        .eval(&format!("{name} = bytearray(b'\\x01') * ({mib} << 20)"))
        .with_context(|| format!("making {id} write {mib} MiB"))?;
    if let Some(e) = out.error {
        bail!("making {id} write {mib} MiB: {e}");
    }
    Ok(())
}

struct Row {
    what: String,
    mib: u64,
    pause_ms: Vec<f64>,
    rebase_ms: Vec<f64>,
    /// When the call would return with no_wait: as the sandbox resumes.
    resumed_ms: Vec<f64>,
    took_ms: Vec<f64>,
    pages: Vec<f64>,
}

impl Row {
    fn new(what: &str, mib: u64) -> Row {
        Row {
            what: what.into(),
            mib,
            pause_ms: Vec::new(),
            rebase_ms: Vec::new(),
            resumed_ms: Vec::new(),
            took_ms: Vec::new(),
            pages: Vec::new(),
        }
    }
}

pub fn run(b: BranchBench) -> Result<i32> {
    if b.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let cfg = crate::local::host_config(Owner::Cli, Limits::default(), Readiness::Agent)?;
    let host = Host::open(cfg)?;
    let header = host.snapshot_header(&b.tag)?;
    let nonce = SandboxId::random("b");
    let tmp_tag =
        |what: &str| Tag::parse(format!("bench-{}-{what}", nonce.as_str())).expect("a valid tag");

    let mut rows: Vec<Row> = Vec::new();
    for &mib in &b.write_mib {
        let mut floor = Row::new("pause + resume (floor)", mib);
        let mut diff = Row::new("branch DIFF", mib);
        let mut live = Row::new("branch LIVE", mib);
        let mut full = Row::new("branch FULL", mib);
        for i in 0..b.runs {
            eprint!("\r  {mib} MiB written: run {}/{}", i + 1, b.runs);
            let (id, _, _) = first_child(&host, &b.tag, None)?;
            let measured = (|| -> Result<()> {
                write_mib(&host, &id, "_tine_bench", mib)?;
                let p = host.pause_resume(&id)?;
                floor.pause_ms.push(ms(p));
                floor.resumed_ms.push(ms(p));
                floor.took_ms.push(ms(p));
                for (row, kind) in [
                    (&mut diff, BranchKind::Diff),
                    (&mut live, BranchKind::Live),
                    (&mut full, BranchKind::Full),
                ] {
                    let t = tmp_tag(&format!("{mib}-{i}-{kind:?}").to_lowercase());
                    let t0 = std::time::Instant::now();
                    let mut resumed = Duration::ZERO;
                    let br = host.branch_then(&id, &t, kind, |_| resumed = t0.elapsed())?;
                    row.pause_ms.push(ms(br.paused));
                    row.resumed_ms.push(ms(resumed));
                    row.rebase_ms.push(br.rebase.map_or(0.0, |r| ms(r.paused)));
                    row.took_ms.push(ms(br.took));
                    row.pages.push(br.pages_written as f64);
                    // The next mode's diff is over the fork's snapshot again (its pages too).
                    host.delete_snapshot(&t)?;
                }
                Ok(())
            })();
            host.kill(&id)?;
            measured?;
        }
        eprintln!();
        rows.extend([floor, diff, live, full]);
    }

    // Repeated branches of one sandbox: it writes the first size, then 1 MiB before each
    // further branch; each branch is a diff over the one before.
    const REPEATS: usize = 4;
    let first_mib = b.write_mib.first().copied().unwrap_or(16);
    let mut repeated: Vec<Row> = (1..=REPEATS)
        .map(|k| Row::new(&format!("branch #{k}"), if k == 1 { first_mib } else { 1 }))
        .collect();
    for i in 0..b.runs {
        eprint!("\r  repeated branches: run {}/{}", i + 1, b.runs);
        let (id, _, _) = first_child(&host, &b.tag, None)?;
        let mut made = Vec::new();
        let measured = (|| -> Result<()> {
            for (k, row) in repeated.iter_mut().enumerate() {
                write_mib(&host, &id, &format!("_tine_rep_{k}"), row.mib)?;
                let t = tmp_tag(&format!("rep-{i}-{k}"));
                let t0 = std::time::Instant::now();
                let mut resumed = Duration::ZERO;
                let br = host.branch_then(&id, &t, BranchKind::Diff, |_| resumed = t0.elapsed())?;
                made.push(t);
                row.pause_ms.push(ms(br.paused));
                row.resumed_ms.push(ms(resumed));
                row.rebase_ms.push(br.rebase.map_or(0.0, |r| ms(r.paused)));
                row.took_ms.push(ms(br.took));
                row.pages.push(br.pages_written as f64);
            }
            Ok(())
        })();
        host.kill(&id)?;
        for t in made.iter().rev() {
            host.delete_snapshot(t)?;
        }
        measured?;
    }
    eprintln!();

    // A chain of diffs: each level a child of the one above that wrote 1 MiB, then branched.
    let mut chain = vec![b.tag.clone()];
    let built = (|| -> Result<()> {
        for d in 1..=b.depth {
            eprint!("\r  building the chain: depth {d}/{}", b.depth);
            let (id, _, _) = first_child(&host, chain.last().unwrap(), None)?;
            let r = write_mib(&host, &id, &format!("_tine_depth_{d}"), 1).and_then(|()| {
                Ok(host.branch(&id, &tmp_tag(&format!("d{d}")), BranchKind::Diff)?)
            });
            host.kill(&id)?;
            chain.push(r?.tag);
        }
        Ok(())
    })();
    eprintln!();
    let mut depths: Vec<(usize, Vec<f64>)> = Vec::new();
    let spawned = built.and_then(|()| {
        let mut at: Vec<usize> = [0, 1, 3, 5, b.depth]
            .into_iter()
            .filter(|d| *d <= b.depth)
            .collect();
        at.dedup();
        for d in at {
            let mut v = Vec::new();
            for _ in 0..b.runs {
                let (id, took, _) = first_child(&host, &chain[d], None)?;
                host.kill(&id)?;
                v.push(ms(took));
            }
            depths.push((d, v));
        }
        Ok(())
    });
    for t in chain.iter().skip(1).rev() {
        let _ = host.delete_snapshot(t);
    }
    spawned?;

    println!(
        "\nbranch of a ready python sandbox ({} MiB guest, snapshot {}), {} run(s) per row; pause = the sandbox's vCPUs parked, return = the whole call:",
        header.mem_size >> 20,
        b.tag,
        b.runs
    );
    let json_rows = print_rows(&mut rows);
    println!(
        "\nrepeated DIFF branches of one sandbox ({first_mib} MiB written before the first, 1 MiB before each next), {} run(s):",
        b.runs
    );
    let json_repeated = print_rows(&mut repeated);
    let base = p50(&mut depths[0].1.clone());

    println!(
        "\nspawn-to-ready from a chain of diffs (each level 1 MiB written), {} run(s) per depth:",
        b.runs
    );
    println!(
        "{:<10} {:>12} {:>12} {:>10}",
        "depth", "p50 ms", "p90 ms", "÷ depth 0"
    );
    let mut json_depths = Vec::new();
    for (d, v) in &mut depths {
        let (m, q) = (p50(v), quantile(v, 0.9));
        println!("{:<10} {m:>12.1} {q:>12.1} {:>9.2}x", d, m / base);
        json_depths.push(serde_json::json!({"depth": d, "ready_ms_p50": m, "ready_ms_p90": q, "ratio_vs_depth0": m / base}));
    }
    println!("DIFF writes only the pages the sandbox wrote since its fork or last branch (found through pagemap) inside the pause; LIVE writes the same after the sandbox resumed, from a fork of its VMM (the pause: vCPU state saved + fork); FULL writes the whole image inside the pause. no_wait = when a call with no_wait returns (the sandbox resumed; the snapshot still being written or published); return = the whole call (wait). After DIFF and LIVE the sandbox is rebased onto the branch in a second pause (rebase: its unchanged pages compared and mapped from the branch). A child of depth D maps its root image and D layers' pages (no copy).");
    let doc = serde_json::json!({
        "bench": "branch", "tag": b.tag.as_str(), "mem_bytes": header.mem_size, "runs": b.runs,
        "pause": json_rows, "repeated": json_repeated, "depth": json_depths,
    });
    println!("json: {doc}");
    if let Some(p) = b.json {
        std::fs::write(&p, doc.to_string()).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(0)
}

/// Print `rows` as a table; their JSON.
fn print_rows(rows: &mut [Row]) -> Vec<serde_json::Value> {
    println!(
        "{:<24} {:>9} {:>14} {:>14} {:>15} {:>16} {:>14} {:>16}",
        "",
        "written",
        "pause p50 ms",
        "pause p90 ms",
        "rebase p50 ms",
        "no_wait p50 ms",
        "return p50 ms",
        "pages written"
    );
    let mut json = Vec::new();
    for r in rows {
        let pages = if r.pages.is_empty() {
            None
        } else {
            Some(p50(&mut r.pages))
        };
        let rebase = if r.rebase_ms.is_empty() {
            None
        } else {
            Some(p50(&mut r.rebase_ms))
        };
        println!(
            "{:<24} {:>6} MiB {:>14.2} {:>14.2} {:>15} {:>16.2} {:>14.2} {:>16}",
            r.what,
            r.mib,
            p50(&mut r.pause_ms),
            quantile(&mut r.pause_ms, 0.9),
            rebase.map_or("-".into(), |m| format!("{m:.2}")),
            p50(&mut r.resumed_ms),
            p50(&mut r.took_ms),
            pages.map_or("-".into(), |p| format!(
                "{p:.0} ({:.1} MiB)",
                p * 4096.0 / 1048576.0
            )),
        );
        json.push(serde_json::json!({
            "what": r.what, "written_mib": r.mib,
            "pause_ms_p50": p50(&mut r.pause_ms), "pause_ms_p90": quantile(&mut r.pause_ms, 0.9),
            "rebase_pause_ms_p50": rebase, "no_wait_return_ms_p50": p50(&mut r.resumed_ms),
            "return_ms_p50": p50(&mut r.took_ms), "pages_written_p50": pages,
        }));
    }
    json
}
