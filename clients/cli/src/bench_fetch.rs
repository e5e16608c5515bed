//! `tine bench fetch`: the first child of a snapshot on a cold host (its layers only in the
//! store) against a warm host (the snapshot on disk), for each way a cold host can restore:
//! eager (fetch and assemble the image first), lazy (pages on first touch) and lazy with the
//! recorded working set prefetched. Also the snapshot's stored size against its memory size.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tine_host::{
    FetchMode, Host, HostConfig, LazyReport, Limits, Owner, Readiness, SpawnOptions, StoreConfig,
};
use tine_proto::names::{SandboxId, Tag};

#[derive(clap::Args)]
pub struct FetchBench {
    /// Snapshot tag on this host (made with `tine snapshot`).
    #[arg(long)]
    tag: Tag,
    /// The store the cold hosts fetch from (default: a new directory under the data dir,
    /// removed afterwards). s3://bucket/prefix works too (AWS_* variables).
    #[arg(long)]
    store: Option<String>,
    /// First-child spawns per mode, each on a new cold host.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// One first-child spawn.
struct Run {
    ready_ms: f64,
    /// Bytes fetched from the store by the time the child was ready.
    fetched: u64,
    lazy: Option<LazyReport>,
    /// Lazy modes: until the background fetch had the whole image here.
    image_ms: Option<f64>,
}

fn host_cfg(base: &HostConfig, data: &Path, store: &str, fetch: FetchMode) -> HostConfig {
    HostConfig {
        data_dir: data.to_path_buf(),
        store: Some(StoreConfig {
            url: store.to_string(),
            layer_cache: data.join("layers"),
            fetch,
            cache_max_bytes: None,
            gc_grace: tine_host::DEFAULT_GC_GRACE,
        }),
        ..base.clone()
    }
}

/// Spawn one child of `tag` on `host` and time it to ready (the agent answered, clock and
/// RNG fixed up).
pub(crate) fn first_child(
    host: &Host,
    tag: &Tag,
    layer: Option<tine_snapshot_store::Digest>,
) -> Result<(SandboxId, Duration, Option<LazyReport>)> {
    host.prestart_workers(1);
    let out = Mutex::new(None);
    let opts = SpawnOptions {
        ready_timeout: Some(Duration::from_secs(300)),
        layer,
        ..SpawnOptions::default()
    };
    let t0 = Instant::now();
    host.spawn(tag, vec![SandboxId::random("bench")], &opts, |o| {
        *out.lock().unwrap() = Some(o)
    })?;
    let took = t0.elapsed();
    let o = out
        .into_inner()
        .unwrap()
        .context("the spawn reported nothing")?;
    if let Err(e) = o.result {
        bail!("child {} failed: {e}", o.id);
    }
    Ok((o.id, took, o.lazy))
}

/// Bytes in a directory tree, as stored on disk.
fn disk_bytes(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => disk_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

pub(crate) fn p50(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[(v.len() - 1) / 2]
}

pub fn run(b: FetchBench) -> Result<i32> {
    if b.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let base = crate::local::host_config(Owner::Cli, Limits::default(), Readiness::Agent)?;
    let scratch = crate::bench::scratch_dir(&base.data_dir, "bench-fetch-")?;
    let store = match &b.store {
        Some(s) => s.clone(),
        None => scratch.path().join("store").display().to_string(),
    };
    // The warm host: this data dir, its snapshot, a layer cache of its own in the scratch dir.
    let mut warm_cfg = host_cfg(&base, &base.data_dir, &store, FetchMode::Eager);
    warm_cfg.store.as_mut().unwrap().layer_cache = scratch.path().join("warm-layers");
    let warm = Host::open(warm_cfg)?;
    let t = Instant::now();
    let info = warm.publish(&b.tag)?;
    println!(
        "published {} to {store} in {:.1} s: head {}, memory {:.1} MiB, non-zero pages {:.1} MiB, stored {:.1} MiB (zstd chunks); working set {} pages recorded, {:.2} MiB stored in chunks of their own",
        b.tag,
        t.elapsed().as_secs_f64(),
        info.head,
        info.memory_bytes as f64 / 1048576.0,
        info.raw_bytes as f64 / 1048576.0,
        info.stored_bytes as f64 / 1048576.0,
        info.working_set_pages,
        info.working_set_stored_bytes as f64 / 1048576.0,
    );
    let mut rows: Vec<(String, Vec<Run>)> = Vec::new();
    let mut warm_runs = Vec::new();
    for _ in 0..b.runs {
        let (id, took, _) = first_child(&warm, &b.tag, None)?;
        warm.kill(&id)?;
        warm_runs.push(Run {
            ready_ms: took.as_secs_f64() * 1e3,
            fetched: 0,
            lazy: None,
            image_ms: None,
        });
    }
    rows.push(("warm host".into(), warm_runs));
    let modes = [
        FetchMode::Eager,
        FetchMode::Lazy { prefetch: false },
        FetchMode::Lazy { prefetch: true },
    ];
    for mode in modes {
        let mut runs = Vec::new();
        for i in 0..b.runs {
            eprint!("\r  cold host, {mode}: run {}/{}", i + 1, b.runs);
            let data = tempfile::tempdir_in(scratch.path())?;
            let cold = Host::open(host_cfg(&base, data.path(), &store, mode))?;
            let t0 = Instant::now();
            let (id, took, lazy) = first_child(&cold, &b.tag, Some(info.head))?;
            let fetched = match &lazy {
                Some(l) => l.fetched_bytes,
                None => disk_bytes(&data.path().join("layers").join("chunks")),
            };
            // Lazy: wait for the background fetch, so it neither skews the next run nor is
            // left half done.
            let image_ms = if lazy.is_some() {
                while cold.snapshot_header(&b.tag).is_err() {
                    if t0.elapsed() > Duration::from_secs(600) {
                        bail!("the image never arrived in the background");
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                Some(t0.elapsed().as_secs_f64() * 1e3)
            } else {
                None
            };
            cold.kill(&id)?;
            runs.push(Run {
                ready_ms: took.as_secs_f64() * 1e3,
                fetched,
                lazy,
                image_ms,
            });
        }
        eprintln!();
        rows.push((format!("cold host, {mode}"), runs));
    }

    let warm_p50 = p50(&mut rows[0].1.iter().map(|r| r.ready_ms).collect::<Vec<_>>());
    let stored = info.stored_bytes.max(1);
    println!(
        "\nfirst child ready (agent answered, clock + RNG fixed up), {} run(s) per row, p50:",
        b.runs
    );
    println!(
        "{:<34} {:>10} {:>8} {:>14} {:>9} {:>8} {:>11} {:>11} {:>10}",
        "",
        "ready ms",
        "÷ warm",
        "fetched MiB",
        "% stored",
        "faults",
        "prefetched",
        "WS pages",
        "image ms"
    );
    let mut json = Vec::new();
    for (name, runs) in &rows {
        let ready = p50(&mut runs.iter().map(|r| r.ready_ms).collect::<Vec<_>>());
        let fetched = p50(&mut runs.iter().map(|r| r.fetched as f64).collect::<Vec<_>>());
        let lazy = |f: fn(&LazyReport) -> u64| {
            let mut v: Vec<f64> = runs
                .iter()
                .filter_map(|r| r.lazy.as_ref().map(|l| f(l) as f64))
                .collect();
            (!v.is_empty()).then(|| p50(&mut v))
        };
        let faults = lazy(|l| l.faults);
        let prefetched = lazy(|l| l.pages_prefetched);
        let ws = lazy(|l| l.working_set_pages);
        let mut im: Vec<f64> = runs.iter().filter_map(|r| r.image_ms).collect();
        let image = (!im.is_empty()).then(|| p50(&mut im));
        let cell = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.0}"));
        println!(
            "{name:<34} {ready:>10.1} {:>7.2}x {:>14.2} {:>8.1}% {:>8} {:>11} {:>11} {:>10}",
            ready / warm_p50,
            fetched / 1048576.0,
            fetched * 100.0 / stored as f64,
            cell(faults),
            cell(prefetched),
            cell(ws),
            cell(image),
        );
        let opt = |v: Option<f64>| v.map_or("null".to_string(), |x| format!("{x:.1}"));
        json.push(format!(
            "{{\"mode\":{name:?},\"ready_ms_p50\":{ready:.3},\"ratio_vs_warm\":{:.3},\"fetched_bytes_p50\":{fetched:.0},\"faults_p50\":{},\"prefetched_pages_p50\":{},\"working_set_pages\":{},\"image_ms_p50\":{}}}",
            ready / warm_p50,
            opt(faults),
            opt(prefetched),
            opt(ws),
            opt(image)
        ));
    }
    let ratio = info.memory_bytes as f64 / stored as f64;
    println!(
        "\nsnapshot {}: memory {:.1} MiB, stored {:.2} MiB: {ratio:.1}x smaller than its memory ({:.1}x smaller than its non-zero pages)",
        b.tag,
        info.memory_bytes as f64 / 1048576.0,
        info.stored_bytes as f64 / 1048576.0,
        info.raw_bytes as f64 / stored as f64,
    );
    println!("`fetched` is what the cold host had taken from the store when the child was ready (eager: all of it); `% stored` is of the snapshot's stored chunks. `image ms`: until the background fetch had the whole image (lazy modes).");
    let doc = format!(
        "{{\"bench\":\"fetch\",\"tag\":{:?},\"store\":{store:?},\"runs\":{},\"memory_bytes\":{},\"nonzero_bytes\":{},\"stored_bytes\":{},\"working_set_pages\":{},\"working_set_stored_bytes\":{},\"compression_vs_memory\":{ratio:.2},\"rows\":[{}]}}",
        b.tag.as_str(),
        b.runs,
        info.memory_bytes,
        info.raw_bytes,
        info.stored_bytes,
        info.working_set_pages,
        info.working_set_stored_bytes,
        json.join(",")
    );
    println!("json: {doc}");
    if let Some(p) = b.json {
        std::fs::write(&p, &doc).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(0)
}
