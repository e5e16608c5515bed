//! `tine bench net`: what a child network costs and carries. Spawn-to-ready of children with
//! and without a network (one at a time, the namespaces pooled as a daemon keeps them), TCP
//! throughput between a guest and a server in a namespace the bench makes (Debian's iperf3
//! on both ends: the host's binary and libraries are copied into the guest), and HTTP
//! requests per second to a server in the guest through an exposed port. Sets up child
//! networks on this host like an executor does (forwarding on, the `inet tine` table).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use tine_agent::client::{AgentClient, ExecOptions};
use tine_host::network::{NetConfig, Policy};
use tine_host::{Host, Limits, Owner, Readiness, SpawnOptions, SpawnPhases};
use tine_proto::names::{SandboxId, Tag};
use tine_vmm::kvm_stats::Counters;

use crate::bench_fetch::p50;

#[derive(clap::Args)]
pub struct NetBench {
    /// The image the parent boots (it needs python3).
    #[arg(long, default_value = "python-numpy")]
    image: String,
    /// Children spawned one at a time, with and without a network.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Seconds of each iperf3 run and of each request loop.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The "internet" the bench talks to: a namespace with one end of a veth pair.
const INET_NS: &str = "tine-bench-inet";
const INET_HOST: &str = "198.51.100.1";
const INET_ADDR: &str = "198.51.100.2";

struct Inet;

impl Inet {
    fn make() -> Result<Inet> {
        Inet::remove();
        let ip = |args: &str| -> Result<()> {
            let st = Command::new("ip").args(args.split_whitespace()).status()?;
            if !st.success() {
                bail!("ip {args} failed");
            }
            Ok(())
        };
        ip(&format!("netns add {INET_NS}"))?;
        let inet = Inet;
        ip(&format!(
            "link add tbinet type veth peer name tbinet0 netns {INET_NS}"
        ))?;
        ip(&format!("addr add {INET_HOST}/24 dev tbinet"))?;
        ip("link set tbinet up")?;
        ip(&format!("-n {INET_NS} addr add {INET_ADDR}/24 dev tbinet0"))?;
        ip(&format!("-n {INET_NS} link set tbinet0 up"))?;
        ip(&format!("-n {INET_NS} link set lo up"))?;
        Ok(inet)
    }

    fn remove() {
        let _ = Command::new("ip")
            .args(["link", "del", "tbinet"])
            .stderr(Stdio::null())
            .status();
        let _ = Command::new("ip")
            .args(["netns", "del", INET_NS])
            .stderr(Stdio::null())
            .status();
    }

    /// A one-shot iperf3 server in the namespace.
    fn iperf3_server(&self) -> Result<Child> {
        let c = Command::new("ip")
            .args([
                "netns", "exec", INET_NS, "iperf3", "-s", "-1", "-B", INET_ADDR,
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting iperf3 -s (apt install iperf3)")?;
        std::thread::sleep(Duration::from_millis(500));
        Ok(c)
    }
}

impl Drop for Inet {
    fn drop(&mut self) {
        Inet::remove();
    }
}

fn spawn_one(host: &Host, tag: &Tag, network: Option<Policy>) -> Result<(SandboxId, SpawnPhases)> {
    host.prestart_workers(1);
    let out = Mutex::new(None);
    let opts = SpawnOptions {
        ready_timeout: Some(Duration::from_secs(300)),
        network,
        ..SpawnOptions::default()
    };
    host.spawn(tag, vec![SandboxId::random("bench")], &opts, |o| {
        *out.lock().unwrap() = Some(o)
    })?;
    let o = out
        .into_inner()
        .unwrap()
        .context("the spawn reported nothing")?;
    match o.result {
        Ok(p) => Ok((o.id, p)),
        Err(e) => bail!("child {} failed: {e}", o.id),
    }
}

/// Copy the host's iperf3 and the libraries it needs beyond the C library into the guest's
/// /tmp/iperf3 (guest and host are both Debian bookworm).
fn install_iperf3(agent: &AgentClient) -> Result<()> {
    let ldd = Command::new("ldd").arg("/usr/bin/iperf3").output()?;
    let mut files = vec![PathBuf::from("/usr/bin/iperf3")];
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let Some(path) = line
            .split("=> ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
        else {
            continue;
        };
        let name = Path::new(path)
            .file_name()
            .unwrap_or_default()
            .to_string_lossy();
        if !["libc.so", "libm.so"].iter().any(|l| name.starts_with(l)) {
            files.push(PathBuf::from(path));
        }
    }
    agent.exec_output(&["mkdir", "-p", "/tmp/iperf3"], &ExecOptions::default())?;
    for f in files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        let data = std::fs::read(&f)
            .with_context(|| format!("reading {} (apt install iperf3)", f.display()))?;
        agent.write_file(&format!("/tmp/iperf3/{name}"), 0o755, &data[..])?;
    }
    Ok(())
}

/// iperf3 from the guest to the namespace's server (`reverse`: server to guest); bits/s.
fn iperf3(inet: &Inet, agent: &AgentClient, seconds: u64, reverse: bool) -> Result<f64> {
    let mut server = inet.iperf3_server()?;
    let t = seconds.to_string();
    let mut argv = vec!["/tmp/iperf3/iperf3", "-c", INET_ADDR, "-t", &t, "-J"];
    if reverse {
        argv.push("-R");
    }
    let opts = ExecOptions {
        env: vec![("LD_LIBRARY_PATH".into(), "/tmp/iperf3".into())],
        timeout: Some(Duration::from_secs(seconds + 60)),
        ..ExecOptions::default()
    };
    let (status, out, err) = agent.exec_output(&argv, &opts)?;
    let _ = server.kill();
    let _ = server.wait();
    if !status.success() {
        bail!(
            "iperf3 in the guest: {}{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        );
    }
    let doc: serde_json::Value = serde_json::from_slice(&out).context("iperf3's JSON")?;
    if let Some(e) = doc["error"].as_str() {
        bail!("iperf3 in the guest: {e}");
    }
    doc["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .with_context(|| {
            let end = doc["end"].to_string();
            format!("iperf3's JSON has no end.sum_received.bits_per_second; its end: {end:.400}")
        })
}

/// JSON object `doc` with `"key":value` added at its end.
fn with_field(doc: &str, key: &str, value: &str) -> String {
    // Only the object's own closing brace: the last field's value may end in one too.
    let open = doc.strip_suffix('}').unwrap_or(doc);
    format!("{open},{key:?}:{value}}}")
}

/// What KVM counted for one child over a stretch of its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct KvmDelta {
    exits: u64,
    mmio_exits: u64,
    irq_injections: u64,
}

impl KvmDelta {
    fn between(before: &Counters, after: &Counters) -> KvmDelta {
        let d = |n: &str| after.get(n).saturating_sub(before.get(n));
        KvmDelta {
            exits: d("exits"),
            mmio_exits: d("mmio_exits"),
            irq_injections: d("irq_injections"),
        }
    }

    fn json(d: &Option<KvmDelta>) -> String {
        match d {
            Some(d) => format!(
                "{{\"exits\":{},\"mmio_exits\":{},\"irq_injections\":{}}}",
                d.exits, d.mmio_exits, d.irq_injections
            ),
            None => "null".into(),
        }
    }
}

/// `f`'s result, and the child's KVM counters over it (None where KVM has no statistics files).
fn kvm_during<T>(
    host: &Host,
    id: &SandboxId,
    f: impl FnOnce() -> Result<T>,
) -> Result<(T, Option<KvmDelta>)> {
    let before = host.kvm_counters(id)?;
    let out = f()?;
    let after = host.kvm_counters(id)?;
    Ok((
        out,
        before.zip(after).map(|(b, a)| KvmDelta::between(&b, &a)),
    ))
}

/// Requests per second for `seconds`, a new connection per request (HTTP/1.0).
fn requests_per_second(addr: &str, seconds: u64) -> Result<f64> {
    let t0 = Instant::now();
    let mut n = 0u64;
    while t0.elapsed() < Duration::from_secs(seconds) {
        let mut c =
            std::net::TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
        c.set_read_timeout(Some(Duration::from_secs(10)))?;
        c.write_all(b"GET / HTTP/1.0\r\n\r\n")?;
        let mut body = Vec::new();
        c.read_to_end(&mut body)?;
        if !body.starts_with(b"HTTP/1.0 200") {
            bail!(
                "{addr} answered {:?}",
                String::from_utf8_lossy(&body[..body.len().min(40)])
            );
        }
        n += 1;
    }
    Ok(n as f64 / t0.elapsed().as_secs_f64())
}

pub fn run(b: NetBench) -> Result<i32> {
    if b.runs == 0 || b.seconds == 0 {
        bail!("--runs and --seconds must be at least 1");
    }
    let base = crate::local::host_config(Owner::Cli, Limits::default(), Readiness::Agent)?;
    let scratch = crate::bench::scratch_dir(&base.data_dir, "bench-net-")?;
    let mut cfg = base.clone();
    cfg.data_dir = scratch.path().to_path_buf();
    let plain = Host::open(cfg.clone())?;
    cfg.network = Some(NetConfig {
        pool: 2,
        ..NetConfig::default()
    });
    let net = Host::open(cfg)?;
    net.fill_pool();
    let tag = Tag::parse("bench-net")?;
    crate::bench::boot_parent(&net, &b.image, &tag, "booted with a network interface")?;

    // Spawn-to-ready, alternating so drift in the host's load hits both alike; each spawn
    // starts once the pools are full again (a refill running beside it is another cost,
    // that of a burst).
    let (mut with, mut without) = (Vec::new(), Vec::new());
    let pool = net.network().map_or(0, |n| n.config().pool);
    for _ in 0..b.runs {
        let t = Instant::now();
        while net.network().is_some_and(|n| n.idle() < pool)
            && t.elapsed() < Duration::from_secs(60)
        {
            std::thread::sleep(Duration::from_millis(50));
        }
        std::thread::sleep(Duration::from_millis(200));
        let (id, p) = spawn_one(&net, &tag, None)?;
        with.push(p);
        net.kill(&id)?;
        let (id, p) = spawn_one(&plain, &tag, None)?;
        without.push(p);
        plain.kill(&id)?;
    }
    let p50_of = |runs: &[SpawnPhases], i: usize| {
        p50(&mut runs
            .iter()
            .map(|p| p.named()[i].1.as_secs_f64() * 1e3)
            .collect::<Vec<_>>())
    };
    let names = SpawnPhases::default().named().map(|(n, _)| n);
    let total = names.len() - 1;
    let (with_p50, without_p50, phase_p50) = (
        p50_of(&with, total),
        p50_of(&without, total),
        p50_of(&with, 0),
    );

    // Throughput and requests, on one child.
    let inet = Inet::make()?;
    let (id, _) = spawn_one(&net, &tag, None)?;
    let agent = tine_host::ready::agent(&net.vm_dir(&id)?.join("vsock.sock"));
    install_iperf3(&agent)?;
    let (up, up_kvm) = kvm_during(&net, &id, || iperf3(&inet, &agent, b.seconds, false))?;
    let (down, down_kvm) = kvm_during(&net, &id, || iperf3(&inet, &agent, b.seconds, true))?;
    let started = agent.eval(
        "import threading, http.server; _srv = http.server.ThreadingHTTPServer(('0.0.0.0', 8000), http.server.SimpleHTTPRequestHandler); threading.Thread(target=_srv.serve_forever, daemon=True).start(); 'serving'",
    )?;
    if let Some(e) = started.error {
        bail!("starting the guest's HTTP server: {e}");
    }
    let exposed = net.expose_port(&id, 8000)?.to_string();
    let link = net
        .list()
        .into_iter()
        .find(|v| v.record.id == id)
        .and_then(|v| v.record.net)
        .and_then(|n| net.network()?.guest_address(&n))
        .context("the child's link address")?;
    let direct = format!("{link}:8000");
    let rps_exposed = requests_per_second(&exposed, b.seconds)?;
    let rps_direct = requests_per_second(&direct, b.seconds)?;
    net.kill(&id)?;
    drop(inet);
    if let Some(n) = net.network() {
        n.remove_host_table();
    }

    println!("\nchild networks, {} children one at a time each way; iperf3 and request loops {} s each\n", b.runs, b.seconds);
    println!("| measure | value | how |");
    println!("| --- | ---: | --- |");
    println!("| spawn-to-ready p50, no network | {without_p50:.1} ms | executor without child networks, same snapshot (its interface has no link) |");
    println!("| spawn-to-ready p50, with network | {with_p50:.1} ms | namespace from the pool, default policy |");
    println!("| of which `network` phase p50 | {phase_p50:.2} ms | taking the namespace (and applying a policy if it differs) |");
    println!("| TCP guest -> server | {:.0} Mbit/s | iperf3 -c in the guest, iperf3 -s in a namespace on this host |", up / 1e6);
    println!(
        "| TCP server -> guest | {:.0} Mbit/s | iperf3 -c -R |",
        down / 1e6
    );
    for (way, kvm, bps) in [
        ("guest -> server", &up_kvm, up),
        ("server -> guest", &down_kvm, down),
    ] {
        let mib = bps * b.seconds as f64 / 8.0 / (1 << 20) as f64;
        match kvm {
            Some(k) => println!(
                "| KVM during TCP {way}, per MiB moved | {:.1} exits, {:.1} to the VMM for MMIO, {:.1} interrupts injected | the child's KVM counters around the iperf3 run (its exec through the agent included): {} exits, {} MMIO, {} injections for {mib:.0} MiB |",
                k.exits as f64 / mib.max(1e-9),
                k.mmio_exits as f64 / mib.max(1e-9),
                k.irq_injections as f64 / mib.max(1e-9),
                k.exits,
                k.mmio_exits,
                k.irq_injections
            ),
            None => println!("| KVM during TCP {way} | - | KVM statistics files not available (Linux 5.14+) |"),
        }
    }
    println!("| HTTP requests/s, exposed port | {rps_exposed:.0} | {exposed}: a connection per request to python's http.server in the guest |");
    println!("| HTTP requests/s, link address | {rps_direct:.0} | {direct}: the same without the host's forwarder |");
    let doc = format!(
        "{{\"bench\":\"net\",\"image\":{:?},\"runs\":{},\"seconds\":{},\"spawn_ready_ms_p50_without\":{without_p50:.3},\"spawn_ready_ms_p50_with\":{with_p50:.3},\"network_phase_ms_p50\":{phase_p50:.3},\"tcp_up_bps\":{up:.0},\"tcp_down_bps\":{down:.0},\"http_rps_exposed\":{rps_exposed:.1},\"http_rps_link\":{rps_direct:.1},\"tcp_up_kvm\":{},\"tcp_down_kvm\":{}}}",
        b.image,
        b.runs,
        b.seconds,
        KvmDelta::json(&up_kvm),
        KvmDelta::json(&down_kvm)
    );
    println!("\nspawn phases, p50 ms:\n");
    println!("| phase | with network | without |");
    println!("| --- | ---: | ---: |");
    let mut phases_json = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let (w, wo) = (p50_of(&with, i), p50_of(&without, i));
        println!("| {name} | {w:.2} | {wo:.2} |");
        phases_json.push(format!(
            "{{\"phase\":{name:?},\"with_ms_p50\":{w:.3},\"without_ms_p50\":{wo:.3}}}"
        ));
    }
    let doc = with_field(&doc, "phases", &format!("[{}]", phases_json.join(",")));
    println!("\njson: {doc}");
    if let Some(p) = b.json {
        std::fs::write(&p, &doc).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_goes_inside_the_object_even_after_a_nested_one() {
        let doc = r#"{"a":1,"kvm":{"exits":2}}"#;
        let out = with_field(doc, "phases", "[]");
        assert_eq!(out, r#"{"a":1,"kvm":{"exits":2},"phases":[]}"#);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["kvm"]["exits"], 2);
    }
}
