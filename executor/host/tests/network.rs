//! Child networks on this machine's /dev/kvm with a hand-made idle guest that has a network
//! interface: each child runs in a namespace of its own whose tap its VMM holds, with its
//! policy in the namespace's table and the host-wide isolation rules in the host's; killed
//! children, crashed VMMs, failed set-ups and restarts leave no namespace, link or rule
//! behind (counted over 50 spawn/kill cycles).
//!
//! The whole test runs in a network namespace it makes first, so the machine's own rules
//! and forwarding setting are never touched. Needs root (namespaces, taps, nft) and the `ip`
//! and `nft` commands; without them it says SKIPPED.

use std::collections::HashSet;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

use tine_host::network::{NetConfig, Network, Policy, Target};
use tine_host::testing::{
    kvm_available, serve_as_worker_if_asked, test_host_config, write_idle_guest_snapshot,
    write_idle_guest_snapshot_with_network,
};
use tine_host::{ErrorKind, Host, HostConfig, SpawnOptions, SpawnOutcome};
use tine_proto::names::{SandboxId, Tag};

fn config(data: &Path, links: &str) -> HostConfig {
    HostConfig {
        network: Some(NetConfig {
            links: links.parse().unwrap(),
            pool: 2,
            deny: vec!["192.0.2.0/24".parse().unwrap()],
            ..NetConfig::default()
        }),
        ..test_host_config(data, 16, 2)
    }
}

fn tag(t: &str) -> Tag {
    Tag::parse(t).unwrap()
}

fn spawn(host: &Host, t: &str, n: usize, network: Option<Policy>) -> Vec<SpawnOutcome> {
    let out = Mutex::new(Vec::new());
    let opts = SpawnOptions {
        network,
        ..SpawnOptions::default()
    };
    let ids = (0..n).map(|_| SandboxId::random("n")).collect();
    host.spawn(&tag(t), ids, &opts, |o| out.lock().unwrap().push(o))
        .unwrap();
    out.into_inner().unwrap()
}

fn output(cmd: &str, args: &[&str]) -> String {
    let o = Command::new(cmd).args(args).output().unwrap();
    assert!(
        o.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Child namespaces on the machine and host-side child links in this test's namespace.
fn leftovers() -> (usize, usize) {
    let ns = std::fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("tine-"))
                .count()
        })
        .unwrap_or(0);
    let links = output("ip", &["-o", "link", "show"])
        .lines()
        .filter(|l| l.split(": ").nth(1).is_some_and(|n| n.starts_with("tinen")))
        .count();
    (ns, links)
}

fn net_of(host: &Host, id: &SandboxId) -> String {
    host.list()
        .into_iter()
        .find(|v| &v.record.id == id)
        .and_then(|v| v.record.net)
        .expect("a networked child records its namespace")
}

/// The pid of `id`'s VMM.
fn pid_of(host: &Host, id: &SandboxId) -> u32 {
    let v = host.list().into_iter().find(|v| &v.record.id == id);
    v.expect("a live child").record.process.pid
}

fn ns_exists(name: &str) -> bool {
    Path::new("/run/netns").join(name).exists()
}

fn ready_ids(out: &[SpawnOutcome]) -> Vec<SandboxId> {
    out.iter()
        .map(|o| {
            assert!(o.result.is_ok(), "{}: {:?}", o.id, o.result);
            o.id.clone()
        })
        .collect()
}

fn children_get_their_own_confined_network() {
    let tmp = tempfile::tempdir().unwrap();
    let snaps = tmp.path().join("snapshots");
    write_idle_guest_snapshot_with_network(&snaps.join("net"), 32).unwrap();
    write_idle_guest_snapshot(&snaps.join("plain"), 32).unwrap();
    let before = leftovers();
    let host = Host::open_exclusive(config(tmp.path(), "10.200.0.0/16")).unwrap();
    host.fill_pool();

    // The host-wide rules: children never reach the host, each other, link-local addresses
    // or the operator's deny list.
    let table_name = host.network().unwrap().host_table().to_string();
    let host_table = output("nft", &["list", "table", "inet", &table_name]);
    for rule in [
        "iifname \"tinen*\" drop",
        "iifname \"tinen*\" oifname \"tinen*\" drop",
        "169.254.0.0/16",
        "192.0.2.0/24",
        "masquerade",
    ] {
        assert!(
            host_table.contains(rule),
            "{rule} missing from:\n{host_table}"
        );
    }
    assert_eq!(
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")
            .unwrap()
            .trim(),
        "1"
    );

    // Three children, three namespaces, each tap held by its VMM (carrier up).
    let ids = ready_ids(&spawn(&host, "net", 3, None));
    let names: HashSet<String> = ids.iter().map(|id| net_of(&host, id)).collect();
    assert_eq!(names.len(), 3, "one namespace per child: {names:?}");
    for n in &names {
        let link = output("ip", &["-n", n, "-o", "link", "show", "tap0"]);
        assert!(
            link.contains("LOWER_UP") && !link.contains("NO-CARRIER"),
            "{n}: {link}"
        );
        let table = output(
            "ip",
            &["netns", "exec", n, "nft", "list", "table", "ip", "tine"],
        );
        assert!(table.contains("dnat to 10.254.0.2"), "{n}: {table}");
        assert!(
            table.contains("chain outbound {\n\t\taccept"),
            "the default policy allows the internet: {table}"
        );
    }

    // Each VMM serves its tap from its main thread, as it does its vsock: no device threads.
    for id in &ids {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", pid_of(&host, id))).unwrap();
        let names: Vec<String> = tasks
            .map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).unwrap())
            .map(|n| n.trim().to_string())
            .collect();
        assert!(names.iter().any(|n| n.starts_with("vcpu")), "{names:?}");
        assert!(
            !names.iter().any(|n| n == "net" || n == "vsock"),
            "a device thread in a networked child's VMM: {names:?}"
        );
    }

    // A policy of its own: deny the internet, allow one address and port, deny one network.
    let policy = Policy {
        internet: false,
        allow: vec!["198.51.100.7:8080".parse::<Target>().unwrap()],
        deny: vec!["203.0.113.0/24".parse().unwrap()],
    };
    let strict = ready_ids(&spawn(&host, "net", 1, Some(policy)));
    let n = net_of(&host, &strict[0]);
    let table = output(
        "ip",
        &["netns", "exec", &n, "nft", "list", "table", "ip", "tine"],
    );
    let egress = table.split("chain outbound").nth(1).unwrap();
    let (deny, allow, rest) = (
        egress.find("203.0.113.0/24").unwrap(),
        egress.find("198.51.100.7").unwrap(),
        egress.rfind("reject with icmp admin-prohibited").unwrap(),
    );
    assert!(
        deny < allow && allow < rest,
        "deny, then allow, then refuse: {egress}"
    );
    assert!(egress.contains("th dport 8080 accept"), "{egress}");

    // Killed: its namespace goes with it.
    assert!(host.kill(&strict[0]).unwrap());
    assert!(!ns_exists(&n), "{n} outlived its child");

    // A crashed VMM: the reaper removes its network.
    let victim = &ids[0];
    let victim_ns = net_of(&host, victim);
    let pid = pid_of(&host, victim);
    // SAFETY: signalling a VMM worker this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    let t0 = std::time::Instant::now();
    while host.list().iter().any(|v| &v.record.id == victim) {
        host.reap();
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the crashed VMM was never reaped"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        !ns_exists(&victim_ns),
        "{victim_ns} outlived its crashed VMM"
    );

    // Asking for a network where there is none is refused, before any child.
    let e = host
        .prepare_spawn(
            &tag("plain"),
            &SpawnOptions {
                network: Some(Policy::default()),
                ..SpawnOptions::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Precondition, "{e}");
    assert!(e.to_string().contains("without a network interface"), "{e}");
    // Without asking, such a snapshot's children simply have none.
    let plain = ready_ids(&spawn(&host, "plain", 1, None));
    assert!(host
        .list()
        .iter()
        .any(|v| v.record.id == plain[0] && v.record.net.is_none()));

    // A restart: surviving children keep their networks, one that died meanwhile loses it,
    // and the old pool's prepared namespaces are swept.
    let (keep, lost) = (&ids[1], &ids[2]);
    let (keep_ns, lost_ns) = (net_of(&host, keep), net_of(&host, lost));
    let lost_pid = host
        .list()
        .into_iter()
        .find(|v| &v.record.id == lost)
        .unwrap()
        .record
        .process
        .pid;
    // The daemon stops (children keep running), one child dies while it is down, and a
    // namespace stands for one a crashed daemon left half made.
    drop(host);
    // SAFETY: as above.
    unsafe { libc::kill(lost_pid as i32, libc::SIGKILL) };
    std::thread::sleep(Duration::from_millis(200));
    let half_made = "tine-9999";
    output("ip", &["netns", "add", half_made]);
    std::fs::write(tmp.path().join("net").join(half_made), b"").unwrap();
    let host = Host::open_exclusive(config(tmp.path(), "10.200.0.0/16")).unwrap();
    assert!(ns_exists(&keep_ns), "a re-adopted child keeps its network");
    assert!(
        !ns_exists(&lost_ns),
        "a child that died while the daemon was down loses it"
    );
    assert!(!ns_exists(half_made), "a half-made namespace is swept");
    let recorded: HashSet<String> = host.network().unwrap().recorded().into_iter().collect();
    assert_eq!(
        recorded,
        HashSet::from([keep_ns.clone()]),
        "only the survivor's remains"
    );
    host.kill_all();
    assert!(!ns_exists(&keep_ns));

    // 50 spawn/kill cycles leave nothing behind.
    for i in 0..50 {
        let id = ready_ids(&spawn(&host, "net", 1, None)).remove(0);
        assert!(host.kill(&id).unwrap(), "cycle {i}");
    }
    drop(host);
    let after = leftovers();
    assert_eq!(
        after, before,
        "namespaces and links (before, after) the cycles"
    );
    println!(
        "leak count over 50 spawn/kill cycles: namespaces {} -> {}, links {} -> {}",
        before.0, after.0, before.1, after.1
    );
}

fn a_failed_network_setup_fails_the_child_and_leaks_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    write_idle_guest_snapshot_with_network(&tmp.path().join("snapshots").join("net"), 32).unwrap();
    let before = leftovers();
    // Room for exactly one child network (a /30), and no pool to hold it.
    let mut cfg = config(tmp.path(), "10.201.0.0/30");
    cfg.network.as_mut().unwrap().pool = 0;
    let host = Host::open_exclusive(cfg).unwrap();
    let out = spawn(&host, "net", 2, None);
    let failed: Vec<&SpawnOutcome> = out.iter().filter(|o| o.result.is_err()).collect();
    assert_eq!(failed.len(), 1, "{out:?}");
    let e = failed[0].result.as_ref().unwrap_err();
    assert!(e.to_string().contains("in use"), "{e}");
    assert!(
        !tmp.path().join("vms").join(failed[0].id.as_str()).exists(),
        "no record of the failed child"
    );
    host.kill_all();
    drop(host);
    assert_eq!(leftovers(), before);
}

/// A host closed while its pool is being refilled: the refill's namespace must be gone by the
/// time the drain returns (it used to be released a moment later, or never).
fn a_drain_during_a_refill_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let before = leftovers();
    let cfg = NetConfig {
        links: "10.202.0.0/16".parse().unwrap(),
        pool: 3,
        ..NetConfig::default()
    };
    for round in 0..10 {
        let net = Network::open(cfg.clone(), tmp.path()).unwrap();
        net.refill_in_background();
        // Let the refill get into making a namespace for some rounds, not others.
        std::thread::sleep(Duration::from_millis(round * 15));
        net.remove_host_table();
        assert_eq!(leftovers(), before, "round {round}: namespaces and links");
        assert!(net.recorded().is_empty(), "round {round}: records");
    }
}

/// Takes that find the pool empty make namespaces on the spot; the refill then grows the pool
/// by as many, up to its ceiling, and a quiet period takes it back to its floor, removing the
/// surplus.
fn the_pool_grows_after_a_burst_and_shrinks_when_quiet() {
    let tmp = tempfile::tempdir().unwrap();
    let before = leftovers();
    let cfg = NetConfig {
        links: "10.203.0.0/16".parse().unwrap(),
        pool: 1,
        pool_max: 3,
        pool_shrink_after: Duration::from_secs(1),
        ..NetConfig::default()
    };
    let policy = cfg.default_policy.clone();
    let net = Network::open(cfg, tmp.path()).unwrap();
    net.fill();
    assert_eq!((net.idle(), net.pool_target()), (1, 1));
    // A burst of four: one from the pool, three made on the spot.
    let taken: Vec<_> = (0..4).map(|_| net.take(&policy).unwrap()).collect();
    net.refill_in_background();
    let t0 = std::time::Instant::now();
    while net.idle() < 3 && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(net.pool_target(), 3, "grown by three, held to its ceiling");
    assert_eq!(net.idle(), 3);
    assert_eq!(leftovers().0, before.0 + 4 + 3);
    // Quiet for its shrink period: back to one prepared namespace.
    std::thread::sleep(Duration::from_millis(1_100));
    net.shrink_if_quiet();
    let t0 = std::time::Instant::now();
    while leftovers().0 > before.0 + 4 + 1 && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!((net.idle(), net.pool_target()), (1, 1));
    assert_eq!(leftovers(), (before.0 + 5, before.1 + 5));
    assert_eq!(
        net.recorded().len(),
        5,
        "records of the removed ones are gone"
    );
    for l in taken {
        net.release(l);
    }
    net.remove_host_table();
    assert_eq!(leftovers(), before);
    assert!(net.recorded().is_empty());
}

fn main() {
    serve_as_worker_if_asked();
    if !kvm_available() {
        println!("SKIPPED: /dev/kvm is absent or not usable");
        return;
    }
    let tools = ["ip", "nft"].iter().all(|t| {
        Command::new(t)
            .arg("-V")
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if !tools {
        println!("SKIPPED: `ip` and `nft` are needed (apt install iproute2 nftables)");
        return;
    }
    // SAFETY: unshare of the network namespace affects this (still single) thread only.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        println!(
            "SKIPPED: no network namespace of our own: {}",
            std::io::Error::last_os_error()
        );
        return;
    }
    let filter = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    let tests: [(&str, fn()); 4] = [
        (
            "the_pool_grows_after_a_burst_and_shrinks_when_quiet",
            the_pool_grows_after_a_burst_and_shrinks_when_quiet,
        ),
        (
            "a_drain_during_a_refill_leaves_nothing",
            a_drain_during_a_refill_leaves_nothing,
        ),
        (
            "children_get_their_own_confined_network",
            children_get_their_own_confined_network,
        ),
        (
            "a_failed_network_setup_fails_the_child_and_leaks_nothing",
            a_failed_network_setup_fails_the_child_and_leaks_nothing,
        ),
    ];
    for (name, f) in tests {
        if filter.as_deref().is_some_and(|p| !name.contains(p)) {
            continue;
        }
        println!("test {name} ...");
        f();
        println!("test {name} ... ok");
    }
}
