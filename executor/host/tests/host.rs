//! The host crate on this machine's /dev/kvm with a hand-made idle guest: snapshot, spawn,
//! list, kill, re-adoption after a restart, a stale record whose pid belongs to another
//! process, a full host, and a burst that grows the worker pool only to its ceiling, and a
//! quiet period that takes it back to its floor.
//!
//! Its own main (harness = false): started as `host __vmm-worker`, this binary is the VMM
//! worker the host hands snapshots to, as `tine __vmm-worker` is in production.

use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tine_host::testing::{
    counts, kvm_available, test_host_config, write_checksum_guest_snapshot,
    write_counter_guest_snapshot, write_hog_guest_snapshot, write_idle_guest_snapshot,
    write_stopping_counter_guest_snapshot,
};
use tine_host::{
    BranchKind, CgroupMode, CgroupName, ErrorKind, FetchMode, Host, HostConfig, HostError,
    Liveness, Owner, ProcessIdentity, Resources, SpawnOptions, SpawnOutcome, StoreConfig, VmRecord,
    WorkerStart, WORKER_SUBCOMMAND,
};
use tine_proto::names::{SandboxId, Tag};

fn config(data: &Path, max_vms: u32, pool_size: usize) -> HostConfig {
    test_host_config(data, max_vms, pool_size)
}

fn tag() -> Tag {
    Tag::parse("idle").unwrap()
}

/// A data directory holding the idle guest's snapshot under tag `idle`.
fn data_dir_with_snapshot() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("snapshots").join("idle");
    std::fs::create_dir_all(dir.parent().unwrap()).unwrap();
    write_idle_guest_snapshot(&dir, 32).unwrap();
    tmp
}

fn ids(n: usize) -> Vec<SandboxId> {
    (0..n).map(|_| SandboxId::random("t")).collect()
}

fn spawn(host: &Host, ids: Vec<SandboxId>) -> Vec<SpawnOutcome> {
    let out = Mutex::new(Vec::new());
    host.spawn(&tag(), ids, &SpawnOptions::default(), |o| {
        out.lock().unwrap().push(o)
    })
    .unwrap();
    out.into_inner().unwrap()
}

fn spawn_list_kill_readopt() {
    let tmp = data_dir_with_snapshot();
    let host = Host::open_exclusive(config(tmp.path(), 8, 2)).unwrap();
    host.fill_pool();
    let outcomes = spawn(&host, ids(3));
    for o in &outcomes {
        let phases = o.result.as_ref().expect("child ready");
        assert!(phases.restore > Duration::ZERO && phases.total >= phases.restore);
        assert!(o.pid.is_some());
    }
    let listed = host.list();
    assert_eq!(listed.len(), 3, "{listed:?}");
    assert!(listed.iter().all(
        |v| v.liveness == Liveness::Running && v.record.owner == Owner::Executor("test".into())
    ));

    // A second daemon on the same data directory is refused while the first holds it.
    let second = Host::open_exclusive(config(tmp.path(), 8, 0));
    assert!(
        matches!(second, Err(HostError::Locked { .. })),
        "{:?}",
        second.err()
    );
    let said = second.err().unwrap().to_string();
    assert!(
        said.contains(&format!("pid {}", std::process::id())),
        "names the holder: {said}"
    );

    // Kill one without any guest cooperation.
    let victim = outcomes[0].id.clone();
    let rec = listed
        .iter()
        .find(|v| v.record.id == victim)
        .unwrap()
        .record
        .clone();
    assert!(host.kill(&victim).unwrap());
    assert!(!rec.dir.exists());
    assert_eq!(rec.liveness(), Liveness::Exited);
    assert!(!host.kill(&victim).unwrap(), "a second kill finds nothing");
    assert_eq!(host.live_ids().len(), 2);

    // Restart: the children keep running; a new host for the same owner adopts them.
    drop(host);
    let host = Host::open_exclusive(config(tmp.path(), 8, 0)).unwrap();
    let mut adopted = host.live_ids();
    adopted.sort();
    let mut want: Vec<SandboxId> = outcomes[1..].iter().map(|o| o.id.clone()).collect();
    want.sort();
    assert_eq!(adopted, want);
    // An adopted child is killed through its pidfd, and a reap notices nothing amiss.
    assert!(host.kill(&want[0]).unwrap());
    assert!(host.reap().is_empty());
    host.kill_all();
    assert!(host.live_ids().is_empty());
    assert!(host.list().is_empty());
}

fn stale_record_is_neither_adopted_nor_killed() {
    let tmp = tempfile::tempdir().unwrap();
    // Another process that happens to have the pid a record names (as after a reboot).
    let mut bystander = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    let real = ProcessIdentity::of(bystander.id()).unwrap();
    let id = SandboxId::random("stale");
    let dir = tmp.path().join("vms").join(id.as_str());
    std::fs::create_dir_all(&dir).unwrap();
    VmRecord {
        id: id.clone(),
        tag: Some(tag()),
        owner: Owner::Executor("test".into()),
        process: ProcessIdentity {
            start_ticks: real.start_ticks + 17,
            ..real.clone()
        },
        created_unix_ms: 0,
        ready: true,
        pages_from_host: false,
        dir: dir.clone(),
        net: None,
        cgroup: None,
    }
    .write()
    .unwrap();
    let host = Host::open_exclusive(config(tmp.path(), 8, 0)).unwrap();
    assert!(
        host.live_ids().is_empty(),
        "a stale record must not be adopted"
    );
    assert!(!dir.exists(), "the stale record is cleared");
    assert!(!host.kill(&id).unwrap());
    assert_eq!(
        real.liveness(),
        Liveness::Running,
        "the bystander still runs"
    );
    let _ = bystander.kill();
    let _ = bystander.wait();
}

fn a_full_host_refuses_with_exhausted() {
    let tmp = data_dir_with_snapshot();
    let host = Host::open_exclusive(config(tmp.path(), 2, 0)).unwrap();
    let outcomes = spawn(&host, ids(3));
    let ok = outcomes.iter().filter(|o| o.result.is_ok()).count();
    let full: Vec<&HostError> = outcomes
        .iter()
        .filter_map(|o| o.result.as_ref().err())
        .collect();
    assert_eq!(ok, 2);
    assert_eq!(full.len(), 1);
    assert_eq!(full[0].kind(), ErrorKind::Exhausted, "{}", full[0]);
    assert!(full[0].to_string().contains("2 of 2"), "{}", full[0]);
    // Unknown and duplicate things are typed too.
    let err = host
        .spawn(
            &Tag::parse("nope").unwrap(),
            ids(1),
            &SpawnOptions::default(),
            |_| {},
        )
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    host.kill_all();
}

/// Spawn one child of `tag` with `resources`.
fn spawn_limited(host: &Host, tag: &str, resources: Resources) -> SpawnOutcome {
    let out = Mutex::new(Vec::new());
    let opts = SpawnOptions {
        resources,
        ..SpawnOptions::default()
    };
    host.spawn(&Tag::parse(tag).unwrap(), ids(1), &opts, |o| {
        out.lock().unwrap().push(o)
    })
    .unwrap();
    out.into_inner().unwrap().pop().unwrap()
}

/// Without cgroups (off, or a host that cannot give them), limits are refused, not ignored;
/// a named cgroup that is not one fails the host's start.
fn limits_without_cgroups_are_refused() {
    let tmp = data_dir_with_snapshot();
    let host = Host::open_exclusive(config(tmp.path(), 4, 0)).unwrap();
    assert!(host.cgroups().is_none());
    let opts = SpawnOptions {
        resources: Resources {
            memory_limit_mib: 128,
            cpu_millis: 0,
        },
        ..SpawnOptions::default()
    };
    let err = host.prepare_spawn(&tag(), &opts).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Precondition, "{err}");
    assert!(err.to_string().contains("without cgroups"), "{err}");
    let err = host.spawn(&tag(), ids(1), &opts, |_| {}).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Precondition, "{err}");
    assert!(host.live_ids().is_empty());
    // No limits asked: children run (unconfined) as before.
    assert!(spawn(&host, ids(1))[0].result.is_ok());
    host.kill_all();
    drop(host);
    let cfg = HostConfig {
        cgroups: CgroupMode::At(tmp.path().join("not-a-cgroup")),
        ..config(tmp.path(), 4, 0)
    };
    let err = Host::open_exclusive(cfg).err().expect("refused");
    assert!(
        err.to_string().contains("not a cgroup v2 directory"),
        "{err}"
    );
}

/// Where cgroup v2 holds the memory, cpu and pids controllers (CI runs this in the nested
/// lab, whose L1 has them; elsewhere it says it skipped): each child in its own cgroup, a
/// guest that writes without bound killed at its limit and reported so while its sibling
/// runs on, a busy guest held to its CPU share, the snapshot's pages charged to the host,
/// limits below the floor refused, and cgroups removed with their children.
fn children_are_held_to_their_cgroup_limits() {
    let tmp = data_dir_with_snapshot();
    let snaps = tmp.path().join("snapshots");
    write_hog_guest_snapshot(&snaps.join("hog"), 256).unwrap();
    write_counter_guest_snapshot(&snaps.join("busy"), 32).unwrap();
    let cfg = HostConfig {
        cgroups: CgroupMode::Auto,
        ..config(tmp.path(), 8, 0)
    };
    let host = Host::open_exclusive(cfg.clone()).unwrap();
    let Some(cg) = host.cgroups() else {
        println!(
            "SKIPPED: no usable cgroup v2 here: {}",
            host.cgroups_refused()
        );
        return;
    };
    let res = |memory_limit_mib, cpu_millis| Resources {
        memory_limit_mib,
        cpu_millis,
    };

    // Below the floor: refused before any child, naming it.
    let opts = SpawnOptions {
        resources: res(16, 0),
        ..SpawnOptions::default()
    };
    let err = host.prepare_spawn(&tag(), &opts).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    assert!(err.to_string().contains("floor of 64 MiB"), "{err}");

    // An idle sibling with the default limit: its guest's RAM plus the VMM's overhead.
    let idle = spawn_limited(&host, "idle", Resources::default());
    idle.result.as_ref().expect("idle child ready");
    let u = host.usage(&idle.id).unwrap().expect("a cgroup");
    assert_eq!(u.memory_max, Some((32 + 128) << 20));
    // The snapshot's pages are the host's: the child holds its VMM and what it wrote.
    assert!(u.memory_current < 32 << 20, "{u:?}");
    let dir = host.cgroup_dir(&idle.id).unwrap();
    // Its VMM, and nothing else but the kernel threads KVM starts for the VM in its cgroup.
    let pids = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
    let pids: Vec<&str> = pids.lines().collect();
    assert!(
        pids.contains(&idle.pid.unwrap().to_string().as_str()),
        "{pids:?}"
    );
    for p in pids {
        let st = std::fs::read_to_string(format!("/proc/{p}/status")).unwrap_or_default();
        let kthread = st.lines().any(|l| l.split_whitespace().eq(["PPid:", "2"]));
        assert!(p == idle.pid.unwrap().to_string() || kthread, "{p}: {st}");
    }

    // A busy guest at 100 millis: about a tenth of a core, throttled.
    let busy = spawn_limited(&host, "busy", res(64, 100));
    busy.result.as_ref().expect("busy child ready");
    let before = host.usage(&busy.id).unwrap().unwrap();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let after = host.usage(&busy.id).unwrap().unwrap();
    let share = (after.cpu_usage - before.cpu_usage).as_secs_f64() / t.elapsed().as_secs_f64();
    println!("busy guest at cpu_millis 100 used {share:.3} of a core");
    assert!(share < 0.2, "share {share}");
    assert!(after.cpu_throttled > before.cpu_throttled, "{after:?}");

    // A guest writing 248 MiB under a 64 MiB limit: killed, and said so.
    let hog = spawn_limited(&host, "hog", res(64, 0));
    let oom = match &hog.result {
        Err(e) => {
            assert_eq!(e.reason(), "out_of_memory", "{e}");
            assert!(e.to_string().contains("limit of 64 MiB"), "{e}");
            true
        }
        Ok(_) => {
            let t = Instant::now();
            loop {
                let ended = host.reap();
                if let Some(e) = ended.iter().find(|e| e.id == hog.id) {
                    assert!(e.out_of_memory, "{e:?}");
                    assert!(e.reason.contains("limit of 64 MiB"), "{e:?}");
                    break true;
                }
                assert!(
                    t.elapsed() < Duration::from_secs(60),
                    "the hog was never killed"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    };
    assert!(oom);
    // The hog's cgroup is removed: what is left are its siblings'.
    let vms = dir.parent().unwrap().to_path_buf();
    let cgroups_left = || -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(&vms)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        v.sort();
        v
    };
    let mut siblings = vec![dir.clone(), host.cgroup_dir(&busy.id).unwrap()];
    siblings.sort();
    assert_eq!(cgroups_left(), siblings);
    // Its siblings run on.
    let live = host.live_ids();
    assert!(
        live.contains(&idle.id) && live.contains(&busy.id),
        "{live:?}"
    );

    // Killed: its cgroup goes with it. A restart keeps the survivor's and removes strays.
    let busy_dir = host.cgroup_dir(&busy.id).unwrap();
    assert!(host.kill(&busy.id).unwrap());
    assert!(!busy_dir.exists());
    let stray = cg.dir(&CgroupName::of(&SandboxId::random("stray")));
    std::fs::create_dir(&stray).unwrap();
    drop(host);
    let host = Host::open_exclusive(cfg.clone()).unwrap();
    assert_eq!(host.live_ids(), vec![idle.id.clone()]);
    assert_eq!(host.cgroup_dir(&idle.id), Some(dir.clone()));
    assert!(dir.exists());
    assert!(!stray.exists(), "a stray cgroup is swept at start");
    host.kill_all();
    assert!(!dir.exists());
    assert!(cgroups_left().is_empty(), "{:?}", cgroups_left());
    drop(host);

    // Pre-started workers wait in cgroups of their own, each kept by the child that takes
    // it, held to its limits.
    let mut pooled = cfg.clone();
    pooled.limits.pool_size = 2;
    pooled.limits.auto_refill = false;
    let host = Host::open_exclusive(pooled).unwrap();
    let idle_cgroups = || -> Vec<String> {
        std::fs::read_dir(&vms)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(".idle-"))
            .collect()
    };
    host.prestart_workers(2);
    let waiting = host.idle_worker_pids();
    assert_eq!(waiting.len(), 2);
    assert_eq!(idle_cgroups().len(), 2, "{:?}", idle_cgroups());
    for pid in &waiting {
        let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        let name = own.trim().rsplit('/').next().unwrap().to_string();
        assert!(name.starts_with(".idle-"), "worker {pid} waits in {own}");
        let procs = std::fs::read_to_string(vms.join(&name).join("cgroup.procs")).unwrap();
        assert_eq!(procs.trim(), pid.to_string(), "{name}");
    }
    let child = spawn_limited(&host, "idle", Resources::default());
    child.result.as_ref().expect("a pooled child ready");
    let pid = child.pid.unwrap();
    assert!(waiting.contains(&pid), "{pid} was not a pre-started worker");
    let u = host.usage(&child.id).unwrap().expect("a cgroup");
    assert_eq!(u.memory_max, Some((32 + 128) << 20));
    let child_cg = host.cgroup_dir(&child.id).unwrap();
    let procs = std::fs::read_to_string(child_cg.join("cgroup.procs")).unwrap();
    assert!(procs.lines().any(|l| l == pid.to_string()), "{procs}");
    // The one it waited in: no other was made for it.
    assert_eq!(idle_cgroups().len(), 2, "{:?}", idle_cgroups());
    host.kill_all();
    assert!(!child_cg.exists());
    assert_eq!(idle_cgroups().len(), 1, "{:?}", idle_cgroups());
    drop(host);
    assert!(idle_cgroups().is_empty(), "{:?}", idle_cgroups());
}

/// Pre-started workers are ready when pre-starting returns: each is blocked reading its job
/// from stdin, so none of its start-up falls into a spawn's time.
fn prestarted_workers_are_waiting_for_their_job() {
    let tmp = data_dir_with_snapshot();
    let host = Host::open_exclusive(config(tmp.path(), 4, 0)).unwrap();
    host.prestart_workers(2);
    let pids = host.idle_worker_pids();
    assert_eq!(pids.len(), 2);
    for pid in pids {
        // "<syscall number> <first argument> ...": read(2) on descriptor 0 (it may still be
        // between saying so and the call).
        let want = format!("{} 0x0 ", libc::SYS_read);
        let t0 = Instant::now();
        let mut call = String::new();
        while t0.elapsed() < Duration::from_secs(5) {
            call = std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap();
            if call.starts_with(&want) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(call.starts_with(&want), "worker {pid}: {call}");
        // What confinement needs of no job is done while it waits: a mount namespace of its
        // own, no capability left to regain by an exec, no core dumps.
        let proc = std::path::PathBuf::from(format!("/proc/{pid}"));
        assert_ne!(
            std::fs::read_link(proc.join("ns/mnt")).unwrap(),
            std::fs::read_link("/proc/self/ns/mnt").unwrap(),
            "worker {pid}"
        );
        assert_eq!(
            proc_status(&proc.join("status"))["CapBnd"],
            "0000000000000000"
        );
        let limits = std::fs::read_to_string(proc.join("limits")).unwrap();
        let core = limits.lines().find(|l| l.starts_with("Max core file size"));
        assert_eq!(
            core.map(|l| l.split_whitespace().skip(4).take(2).collect::<Vec<_>>()),
            Some(vec!["0", "0"]),
            "{limits}"
        );
    }
    // And they still take jobs.
    assert!(spawn(&host, ids(2)).iter().all(|o| o.result.is_ok()));
    host.kill_all();
}

/// A worker told to keep the executor's user (`--vmm-uid-base off`) gets no view: having
/// entered a mount namespace of its own while it waited, it goes back to the host's.
fn workers_without_a_user_of_their_own_go_back_to_the_host_s_mounts() {
    let tmp = data_dir_with_snapshot();
    let mut cfg = config(tmp.path(), 4, 1);
    cfg.confine.uid_base = None;
    let host = Host::open_exclusive(cfg).unwrap();
    host.fill_pool();
    let out = spawn(&host, ids(1));
    out[0].result.as_ref().expect("spawned");
    let proc = std::path::PathBuf::from(format!("/proc/{}", out[0].pid.expect("a pid")));
    assert_eq!(
        std::fs::read_link(proc.join("ns/mnt")).unwrap(),
        std::fs::read_link("/proc/self/ns/mnt").unwrap()
    );
    assert_eq!(
        std::fs::read_link(proc.join("root")).unwrap(),
        Path::new("/")
    );
    host.kill_all();
}

fn a_burst_leaves_at_most_the_pool_idle() {
    let tmp = data_dir_with_snapshot();
    let (pool, pool_max) = (3, 6);
    let mut cfg = config(tmp.path(), 40, pool);
    cfg.limits.pool_max = pool_max;
    cfg.limits.pool_shrink_after = Duration::from_secs(2);
    let host = Host::open_exclusive(cfg).unwrap();
    host.fill_pool();
    assert_eq!(host.pool_target(), pool);
    // 1000 requests against 40 slots: every one takes the spawn path, 40 get a worker.
    let outcomes = spawn(&host, ids(1000));
    let ready = outcomes.iter().filter(|o| o.result.is_ok()).count();
    let full = outcomes
        .iter()
        .filter(|o| matches!(&o.result, Err(e) if e.kind() == ErrorKind::Exhausted))
        .count();
    assert_eq!(
        ready + full,
        1000,
        "every child is ready or refused as full"
    );
    assert_eq!(ready, 40);
    // 37 children found the pool short: it grows, to its ceiling, once the burst is over.
    let t0 = Instant::now();
    while host.idle_workers() < pool_max && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(host.pool_target(), pool_max);
    assert_eq!(host.idle_workers(), pool_max, "the grown pool is filled");
    // Let any refill finish: never more idle than the target.
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(host.idle_workers(), pool_max);
    for pid in host.idle_worker_pids() {
        assert!(
            Path::new(&format!("/proc/{pid}")).exists(),
            "idle worker {pid} runs"
        );
    }
    host.kill_all();
    // A spawn served from the grown pool finds it no longer short: no growth past it, and
    // the quiet period still ends.
    let outcomes = spawn(&host, ids(2));
    assert!(outcomes.iter().all(|o| o.result.is_ok()));
    host.kill_all();
    let t0 = Instant::now();
    while host.idle_workers() < pool_max && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(host.pool_target(), pool_max);
    // Quiet for its shrink period: the daemon's reaping takes it back to its floor, ending
    // the surplus workers.
    std::thread::sleep(Duration::from_millis(2_100));
    let surplus = host.idle_worker_pids();
    host.reap();
    assert_eq!(host.pool_target(), pool);
    assert!(
        host.idle_workers() <= pool,
        "{} idle workers after the quiet period (floor {pool})",
        host.idle_workers()
    );
    let ended: Vec<u32> = surplus
        .into_iter()
        .filter(|p| !host.idle_worker_pids().contains(p))
        .collect();
    assert!(!ended.is_empty());
    for pid in ended {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "surplus worker {pid} was reaped"
        );
    }
}

/// A kill that arrives while a child waits its turn cancels it: it never starts, and nothing
/// of it is left.
fn killing_a_queued_child_cancels_it() {
    let tmp = data_dir_with_snapshot();
    let host = Host::open_exclusive(config(tmp.path(), 40, 0)).unwrap();
    let all = ids(12);
    let last = all.last().unwrap().clone();
    let out = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        s.spawn(|| {
            host.spawn(
                &tag(),
                all.clone(),
                &SpawnOptions {
                    parallel: 1,
                    ..SpawnOptions::default()
                },
                |o| out.lock().unwrap().push(o),
            )
            .unwrap()
        });
        // The spawn accepts every id at once; the last one waits behind eleven others.
        let t0 = Instant::now();
        while !host.kill(&last).unwrap() {
            assert!(t0.elapsed() < Duration::from_secs(10), "never accepted");
            std::thread::yield_now();
        }
    });
    let out = out.into_inner().unwrap();
    let cancelled = out.iter().find(|o| o.id == last).unwrap();
    let err = cancelled.result.as_ref().unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Cancelled, "{err}");
    assert!(cancelled.pid.is_none(), "a cancelled child never got a VMM");
    assert_eq!(host.live_ids().len(), 11);
    assert!(!tmp.path().join("vms").join(last.as_str()).exists());
    host.kill_all();
}

/// Records of VMM workers a previous daemon left: a ready one is adopted, one it died while
/// making ready is killed (its clock and RNG were never its own), and a record naming a
/// process that is not a VMM worker leaves that process alone.
fn adoption_takes_only_ready_vmm_workers() {
    let tmp = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let start = |args: &[&str]| {
        std::process::Command::new(&exe)
            .args(args)
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let record = |child: &std::process::Child, ready: bool| {
        let id = SandboxId::random("old");
        let dir = tmp.path().join("vms").join(id.as_str());
        std::fs::create_dir_all(&dir).unwrap();
        let r = VmRecord {
            id,
            tag: Some(tag()),
            owner: Owner::Executor("test".into()),
            process: ProcessIdentity::of(child.id()).unwrap(),
            created_unix_ms: 0,
            ready,
            pages_from_host: false,
            dir,
            net: None,
            cgroup: None,
        };
        r.write().unwrap();
        r
    };
    // Idle workers (waiting for a job on stdin) stand for a previous daemon's VMs.
    let mut ready = start(&[WORKER_SUBCOMMAND]);
    let mut unready = start(&[WORKER_SUBCOMMAND]);
    let mut other = start(&[BYSTANDER]);
    std::thread::sleep(Duration::from_millis(100));
    let (r1, r2, r3) = (
        record(&ready, true),
        record(&unready, false),
        record(&other, true),
    );
    let host = Host::open_exclusive(config(tmp.path(), 8, 0)).unwrap();
    assert_eq!(host.live_ids(), vec![r1.id.clone()]);
    assert!(!r2.dir.exists() && !r3.dir.exists());
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(unready.wait().unwrap().signal(), Some(libc::SIGKILL));
    assert_eq!(
        r3.liveness(),
        Liveness::Running,
        "a non-worker is never signalled"
    );
    assert!(host.kill(&r1.id).unwrap());
    assert_eq!(ready.wait().unwrap().signal(), Some(libc::SIGKILL));
    let _ = other.kill();
    let _ = other.wait();
}

fn cmdline_of(pid: u32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .unwrap_or_default()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect()
}

/// Whether worker `pid` was forked by a zygote (it carries the zygote's command line).
fn forked(pid: u32) -> bool {
    cmdline_of(pid)
        .iter()
        .any(|a| a == tine_host::zygote::ZYGOTE_ARG)
}

/// Live zygotes started by this process: its children with the zygote's command line and a
/// socket for stdin (the workers they fork have a pipe).
fn zygotes() -> Vec<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| tine_host::process::parent_of(pid) == Some(me) && forked(pid))
        .filter(|pid| {
            std::fs::read_link(format!("/proc/{pid}/fd/0"))
                .is_ok_and(|l| l.to_string_lossy().starts_with("socket:"))
        })
        .collect()
}

/// Live zygotes of this process that were not among `before` (those of earlier tests' hosts).
fn zygotes_since(before: &[u32]) -> Vec<u32> {
    zygotes()
        .into_iter()
        .filter(|z| !before.contains(z))
        .collect()
}

/// KiB of the test binary's own mappings in `pid` that are dirty and its alone.
fn binary_private_dirty(pid: u32) -> u64 {
    let exe = std::env::current_exe().unwrap();
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut private = 0;
    tine_host::smaps::for_each_field(&smaps, |path, field, kib| {
        if Path::new(path) == exe && field == "Private_Dirty:" {
            private += kib;
        }
    });
    private
}

/// Workers forked from the zygote are this process's children (adopted), and share the pages
/// the loader wrote into the program's data with it, where workers started from the program
/// each hold a private copy.
fn forked_workers_share_what_loading_wrote() {
    let tmp = data_dir_with_snapshot();
    let mut dirty = Vec::new();
    for start in [WorkerStart::Fork, WorkerStart::Exec] {
        let mut cfg = config(tmp.path(), 4, 0);
        cfg.limits.worker_start = start;
        let host = Host::open_exclusive(cfg).unwrap();
        let outcomes = spawn(&host, ids(2));
        for o in &outcomes {
            o.result.as_ref().unwrap();
            let pid = pid_of(&host, &o.id);
            assert_eq!(
                forked(pid),
                start == WorkerStart::Fork,
                "{start}: {:?}",
                cmdline_of(pid)
            );
            assert_eq!(
                tine_host::process::parent_of(pid),
                Some(std::process::id()),
                "{start}: adopted"
            );
            dirty.push((start, binary_private_dirty(pid)));
        }
        // A subreaper only while a worker was being forked.
        let mut subreaper: libc::c_int = -1;
        // SAFETY: prctl writes the setting into our local.
        unsafe {
            libc::prctl(
                libc::PR_GET_CHILD_SUBREAPER,
                &mut subreaper as *mut libc::c_int,
            )
        };
        assert_eq!(subreaper, 0);
        // Each runs its guest.
        for o in &outcomes {
            assert_eq!(
                host.list().iter().filter(|v| v.record.id == o.id).count(),
                1
            );
        }
        host.kill_all();
    }
    eprintln!("     the program's private dirty KiB per worker: {dirty:?}");
    let most = |s| {
        dirty
            .iter()
            .filter(|d| d.0 == s)
            .map(|d| d.1)
            .max()
            .unwrap()
    };
    // Started from the program, the relocated data is each worker's own; forked, it is
    // shared with the zygote and the other workers, and only what is written after is not.
    assert!(
        most(WorkerStart::Fork) * 4 < most(WorkerStart::Exec),
        "{dirty:?}"
    );
}

/// A worker program that cannot be a zygote (it exits at once): workers are started from
/// the program, and children spawn as before.
fn workers_come_from_the_program_when_no_zygote_can_be_had() {
    let tmp = data_dir_with_snapshot();
    let exe = tmp.path().join("no-zygote");
    std::fs::write(
        &exe,
        format!(
            "#!/bin/sh\nif [ \"$2\" = {} ]; then exit 3; fi\nexec '{}' \"$@\"\n",
            tine_host::zygote::ZYGOTE_ARG,
            std::env::current_exe().unwrap().display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = config(tmp.path(), 4, 0);
    cfg.worker_exe = exe;
    let host = Host::open_exclusive(cfg).unwrap();
    for _ in 0..2 {
        let o = spawn(&host, ids(1)).pop().unwrap();
        o.result.as_ref().unwrap();
        let pid = pid_of(&host, &o.id);
        assert!(!forked(pid), "{:?}", cmdline_of(pid));
    }
    host.kill_all();
}

/// A zygote forks at most `FORKS_PER_ZYGOTE` workers: the next is forked by a new one, with
/// an address-space layout of its own.
fn a_zygote_is_replaced_after_its_forks() {
    let tmp = data_dir_with_snapshot();
    let before = zygotes();
    let host = Host::open_exclusive(config(tmp.path(), 2, 0)).unwrap();
    let mut first = None;
    for n in 1..=tine_host::zygote::FORKS_PER_ZYGOTE + 1 {
        let o = spawn(&host, ids(1)).pop().unwrap();
        o.result.as_ref().unwrap();
        assert!(forked(pid_of(&host, &o.id)), "child {n}");
        let z = zygotes_since(&before);
        let last = tine_host::zygote::FORKS_PER_ZYGOTE;
        match (n, first) {
            (1, _) => first = z.first().copied(),
            // The first ends right after its last fork.
            (n, _) if n == last => assert!(z.is_empty(), "child {n}: {z:?}"),
            (n, Some(f)) if n < last => assert_eq!(z, vec![f], "child {n}"),
            (n, f) => {
                assert_eq!(z.len(), 1, "child {n}: {z:?}");
                assert_ne!(Some(z[0]), f, "child {n} came from the first zygote");
            }
        }
        assert!(first.is_some());
        assert!(host.kill(&o.id).unwrap());
    }
    host.kill_all();
}

/// A zygote that dies is replaced: the worker asked of it meanwhile is started from the
/// program, and the next is forked by a new zygote.
fn a_zygote_that_died_is_replaced() {
    let tmp = data_dir_with_snapshot();
    let before = zygotes();
    let host = Host::open_exclusive(config(tmp.path(), 4, 0)).unwrap();
    let first = spawn(&host, ids(1)).pop().unwrap();
    first.result.as_ref().unwrap();
    assert!(forked(pid_of(&host, &first.id)));
    let zygote: Vec<u32> = zygotes_since(&before);
    assert_eq!(zygote.len(), 1, "{zygote:?}");
    // SAFETY: signals our own unreaped child (its pool reaps it).
    assert_eq!(unsafe { libc::kill(zygote[0] as i32, libc::SIGKILL) }, 0);
    let second = spawn(&host, ids(1)).pop().unwrap();
    second.result.as_ref().unwrap();
    assert!(!forked(pid_of(&host, &second.id)));
    let third = spawn(&host, ids(1)).pop().unwrap();
    third.result.as_ref().unwrap();
    assert!(forked(pid_of(&host, &third.id)));
    let now: Vec<u32> = zygotes_since(&before);
    assert_eq!(now.len(), 1, "{now:?}");
    assert_ne!(now[0], zygote[0]);
    // All three are this host's, and end with it.
    assert_eq!(host.live_ids().len(), 3);
    host.kill_all();
    assert!(host.live_ids().is_empty());
}

/// Children of this process that have exited and wait to be reaped, named as this process is
/// (workers, zygotes and go-betweens all run this binary).
fn our_zombies() -> Vec<u32> {
    let me = std::process::id();
    let comm = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let ours = comm(me);
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| tine_host::process::parent_of(pid) == Some(me) && comm(pid) == ours)
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|t| {
                    let (_, f) = tine_host::process::stat_fields(&t)?;
                    Some(f.first()? == &"Z")
                })
                .unwrap_or(false)
        })
        .collect()
}

/// An idle forked worker holds nothing of its zygote's: its stdin is its own pipe, its stderr
/// null, and no descriptor of it is the zygote's socket. And once its host is gone, no worker,
/// zygote or go-between is left unreaped.
fn forked_workers_hold_nothing_of_the_zygote_s() {
    let tmp = data_dir_with_snapshot();
    let before = zygotes();
    let host = Host::open_exclusive(config(tmp.path(), 4, 2)).unwrap();
    host.prestart_workers(2);
    let zygote: Vec<u32> = zygotes_since(&before);
    assert_eq!(zygote.len(), 1, "{zygote:?}");
    let link = |pid: u32, fd: &str| {
        std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
            .map(|l| l.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let zygote_socket = link(zygote[0], "0");
    assert!(zygote_socket.starts_with("socket:"), "{zygote_socket}");
    for pid in host.idle_worker_pids() {
        assert!(forked(pid), "{:?}", cmdline_of(pid));
        assert!(link(pid, "0").starts_with("pipe:"), "{}", link(pid, "0"));
        assert!(link(pid, "1").starts_with("socket:"), "{}", link(pid, "1"));
        assert_eq!(link(pid, "2"), "/dev/null");
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
            let fd = fd.unwrap().file_name().to_string_lossy().into_owned();
            assert_ne!(link(pid, &fd), zygote_socket, "worker {pid} fd {fd}");
        }
    }
    let o = spawn(&host, ids(1)).pop().unwrap();
    o.result.as_ref().unwrap();
    host.kill_all();
    drop(host);
    // The pool goes with its last user (a refill may hold it a few seconds).
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(15)
        && (!zygotes_since(&before).is_empty() || !our_zombies().is_empty())
    {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(our_zombies().is_empty(), "{:?}", our_zombies());
    assert!(zygotes_since(&before).is_empty());
}

/// Run as `host __bystander`, this binary is an unrelated process that merely waits.
const BYSTANDER: &str = "__bystander";

fn with_store(mut cfg: HostConfig, store: &Path) -> HostConfig {
    cfg.store = Some(StoreConfig {
        url: store.display().to_string(),
        layer_cache: cfg.data_dir.join("layers"),
        fetch: FetchMode::Eager,
        cache_max_bytes: None,
        gc_grace: tine_host::DEFAULT_GC_GRACE,
    });
    cfg
}

fn with_fetch(mut cfg: HostConfig, fetch: FetchMode) -> HostConfig {
    cfg.store.as_mut().unwrap().fetch = fetch;
    cfg
}

/// Wait until a child's console shows the checksum line `want`; its last lines otherwise.
fn console_shows(host: &Host, id: &SandboxId, want: &str) -> Result<(), String> {
    let log = host.vm_dir(id).unwrap().join("console.log");
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        // The first line may be cut where the snapshot was taken: look at whole lines after it.
        if text.lines().skip(1).any(|l| l == want) {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let tail: Vec<&str> = text.lines().rev().take(3).collect();
            return Err(format!("no {want:?} on the console; last lines {tail:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Lazy restore on a cold host: the child starts before the image is here, its pages arrive
/// on first touch (from chunks fetched on demand, verified) and are right (the guest prints
/// the checksum of 4 MiB of data it reads); the first lazy child records its working set in
/// the store; the image fills in in the background and later children map it; a third cold
/// host prefetches the recorded working set.
fn a_cold_host_restores_lazily_and_prefetches_the_working_set() {
    let store = tempfile::tempdir().unwrap();
    let a_dir = tempfile::tempdir().unwrap();
    let snap = a_dir.path().join("snapshots").join("idle");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    let sum = write_checksum_guest_snapshot(&snap, 64, 4, 0x5eed).unwrap();
    let want = format!("{sum:016X}");
    let a = Host::open(with_store(config(a_dir.path(), 4, 0), store.path())).unwrap();
    let info = a.publish(&tag()).unwrap();
    let opts = SpawnOptions {
        layer: Some(info.head),
        ..SpawnOptions::default()
    };
    let spawn_on = |h: &Host| {
        let out = Mutex::new(Vec::new());
        h.spawn(&tag(), ids(1), &opts, |o| out.lock().unwrap().push(o))
            .unwrap();
        let mut out = out.into_inner().unwrap();
        assert!(out[0].result.is_ok(), "{out:?}");
        out.remove(0)
    };

    let b_dir = tempfile::tempdir().unwrap();
    let lazy = FetchMode::Lazy { prefetch: true };
    let b = Host::open(with_fetch(
        with_store(config(b_dir.path(), 4, 0), store.path()),
        lazy,
    ))
    .unwrap();
    let first = spawn_on(&b);
    let report = first.lazy.expect("restored lazily");
    println!("  cold host, lazy: {report:?}");
    // Publishing recorded a working set in the layer; a guest without an agent is ready once
    // it runs, so it may be empty, and then the first lazy child records one beside the layer.
    println!(
        "  working set in the layer: {} pages",
        info.working_set_pages
    );
    if info.working_set_pages == 0 {
        assert_eq!(report.pages_prefetched, 0, "no working set yet: {report:?}");
    }
    assert!(
        report.fetched_bytes < info.stored_bytes,
        "ready before the whole image was fetched: {report:?} of {}",
        info.stored_bytes
    );
    console_shows(&b, &first.id, &want).unwrap();

    // The image arrives in the background; later children map it.
    let t0 = Instant::now();
    while b.snapshot_header(&tag()).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the image never arrived"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A guest without an agent is ready once it runs, before it touched much: what it
    // recorded (if anything) is replaced by a working set covering its data, so the prefetch
    // path below has real work.
    let pages: Vec<u64> = (0x100..0x101).chain(0x400..0x800).collect();
    let ws = store
        .path()
        .join(tine_host::lazy::working_set_key(&info.head));
    std::fs::create_dir_all(ws.parent().unwrap()).unwrap();
    std::fs::write(&ws, tine_host::lazy::encode_working_set(&pages)).unwrap();
    let later = spawn_on(&b);
    assert!(later.lazy.is_none(), "the image is here: {:?}", later.lazy);
    console_shows(&b, &later.id, &want).unwrap();

    let c_dir = tempfile::tempdir().unwrap();
    let c = Host::open(with_fetch(
        with_store(config(c_dir.path(), 4, 0), store.path()),
        lazy,
    ))
    .unwrap();
    let child = spawn_on(&c);
    let report = child.lazy.expect("restored lazily");
    println!("  cold host, lazy + working set: {report:?}");
    // The layer's own working set wins over one stored beside it.
    let expect = match info.working_set_pages {
        0 => pages.len() as u64,
        n => n,
    };
    assert_eq!(report.working_set_pages, expect, "{report:?}");
    console_shows(&c, &child.id, &want).unwrap();

    // Killing a lazily served child ends its page server with it.
    c.kill_all();
    b.kill_all();
    assert!(c.live_ids().is_empty() && b.live_ids().is_empty());

    // Every memory chunk in the store corrupted: a lazy child is killed at the first page it
    // cannot get verified (never left running on a page it did not get), and nothing corrupt
    // enters the cache.
    let layer = tine_snapshot_store::cache::LocalCache::open(a_dir.path().join("layers"))
        .unwrap()
        .read_layer(&info.head)
        .unwrap();
    let state = tine_snapshot_store::Digest::from_bytes(&layer.state_ref().hash).unwrap();
    let mut corrupted = Vec::new();
    for i in 0..layer.manifest.chunks.len() {
        let d = layer.chunk_digest(i);
        let p = store
            .path()
            .join(tine_snapshot_store::cache::object_key(&d));
        let mut bytes = std::fs::read(&p).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
        std::fs::write(&p, &bytes).unwrap();
        corrupted.push(d);
    }
    assert!(!corrupted.contains(&state));
    let d_dir = tempfile::tempdir().unwrap();
    let d = Host::open(with_fetch(
        with_store(config(d_dir.path(), 4, 0), store.path()),
        FetchMode::Lazy { prefetch: false },
    ))
    .unwrap();
    let out = Mutex::new(Vec::new());
    d.spawn(&tag(), ids(1), &opts, |o| out.lock().unwrap().push(o))
        .unwrap();
    let out = out.into_inner().unwrap();
    let t0 = Instant::now();
    loop {
        let alive = d.list().iter().any(|v| v.liveness == Liveness::Running);
        if !alive {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the child still runs: {out:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Err(e) = &out[0].result {
        // Not ready before its first fault: the error names the snapshot and the chunk.
        let msg = e.to_string();
        assert!(
            msg.contains("snapshot idle") && msg.contains("chunk"),
            "{msg}"
        );
    }
    let cache = tine_snapshot_store::cache::LocalCache::open(d_dir.path().join("layers")).unwrap();
    for c in &corrupted {
        assert!(!cache.has_object(c), "a corrupt chunk entered the cache");
    }
    d.kill_all();
}

/// A snapshot made on one host is restored on another that only shares the store: the second
/// fetches the layers it lacks (once, however many spawns want them) and spawns real children;
/// a corrupted chunk in the store fails the fetch, naming the snapshot, and leaves nothing
/// that looks like a snapshot behind.
fn a_host_without_the_snapshot_fetches_it_from_the_store() {
    let store = tempfile::tempdir().unwrap();
    let a_dir = data_dir_with_snapshot();
    let mut bad = with_store(config(a_dir.path(), 4, 0), store.path());
    bad.store.as_mut().unwrap().url = "ftp://nowhere/x".into();
    let err = Host::open(bad).err().expect("a bad store URL is refused");
    assert!(err.to_string().contains("unsupported scheme"), "{err}");
    let a = Host::open(with_store(config(a_dir.path(), 4, 0), store.path())).unwrap();
    let info = a.publish(&tag()).unwrap();
    assert_eq!(info.chain, vec![info.head]);
    assert_eq!(info.memory_bytes, 32 << 20);
    assert!(info.stored_bytes > 0 && info.stored_bytes <= info.raw_bytes);

    let b_dir = tempfile::tempdir().unwrap();
    let b = Host::open(with_store(config(b_dir.path(), 4, 0), store.path())).unwrap();
    // Three spawns that all need the snapshot at once: one fetch.
    let fetched: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..3)
            .map(|_| s.spawn(|| b.ensure_local(&tag(), &info.head).unwrap()))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let did: Vec<_> = fetched.iter().flatten().collect();
    assert_eq!(did.len(), 1, "{fetched:?}");
    assert!(did[0].bytes > 0 && did[0].layers == 1, "{did:?}");
    let out = Mutex::new(Vec::new());
    b.spawn(
        &tag(),
        ids(2),
        &SpawnOptions {
            layer: Some(info.head),
            ..SpawnOptions::default()
        },
        |o| out.lock().unwrap().push(o),
    )
    .unwrap();
    let out = out.into_inner().unwrap();
    assert!(out.iter().all(|o| o.result.is_ok()), "{out:?}");
    b.kill_all();

    // Corrupt one chunk in the store: a third host refuses it.
    let chunks = store.path().join("chunks");
    let shard = std::fs::read_dir(&chunks)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let chunk = std::fs::read_dir(&shard)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&chunk).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&chunk, &bytes).unwrap();
    let c_dir = tempfile::tempdir().unwrap();
    let c = Host::open(with_store(config(c_dir.path(), 4, 0), store.path())).unwrap();
    let err = c.ensure_local(&tag(), &info.head).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("snapshot idle") && msg.contains(&store.path().display().to_string()),
        "{msg}"
    );
    let left: Vec<_> = std::fs::read_dir(c_dir.path().join("snapshots"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(
        left.is_empty(),
        "nothing may look like a snapshot: {left:?}"
    );
    assert!(c.snapshot_header(&tag()).is_err());
}

/// A host whose layer cache is bounded keeps a fetched snapshot while a child runs from it,
/// evicts it (image, layers, and the fetched snapshot itself) once none does, ending the
/// workers primed for it, and fetches it again when asked.
fn a_bounded_cache_evicts_what_no_child_runs_from() {
    let store = tempfile::tempdir().unwrap();
    let a_dir = data_dir_with_snapshot();
    let a = Host::open(with_store(config(a_dir.path(), 4, 0), store.path())).unwrap();
    let info = a.publish(&tag()).unwrap();
    let b_dir = tempfile::tempdir().unwrap();
    let mut cfg = with_store(config(b_dir.path(), 4, 2), store.path());
    cfg.store.as_mut().unwrap().cache_max_bytes = Some(1);
    let b = Host::open(cfg).unwrap();
    let opts = SpawnOptions {
        layer: Some(info.head),
        ..SpawnOptions::default()
    };
    let spawn_one = || {
        let out = Mutex::new(Vec::new());
        b.spawn(&tag(), ids(1), &opts, |o| out.lock().unwrap().push(o))
            .unwrap();
        let out = out.into_inner().unwrap();
        assert!(out[0].result.is_ok(), "{out:?}");
    };
    let image = b_dir
        .path()
        .join("layers/images")
        .join(format!("{}.mem", info.head.hex()));
    spawn_one();
    // Over the bound, but a child maps it: kept.
    assert!(image.is_file() && b.snapshot_header(&tag()).is_ok());
    // The pool's refills prime themselves for it.
    let t0 = Instant::now();
    while b.primed_workers(&tag()) < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{} of 2 idle workers primed for the fetched snapshot",
            b.primed_workers(&tag())
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let primed = b.idle_worker_pids();
    b.kill_all();
    b.enforce_cache_bound();
    assert!(!image.exists(), "no child runs from it: evicted");
    assert_eq!(
        b.primed_workers(&tag()),
        0,
        "no worker stays primed for an evicted snapshot"
    );
    for pid in primed {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "worker {pid}, primed for the evicted snapshot, was ended"
        );
    }
    assert!(
        b.snapshot_header(&tag()).is_err(),
        "the fetched snapshot went with its image"
    );
    let left = std::fs::read_dir(b_dir.path().join("layers/layers"))
        .unwrap()
        .count();
    assert_eq!(left, 0, "its layer went too");
    spawn_one();
    assert!(image.is_file(), "fetched again");
    b.kill_all();
}

/// Deleting a snapshot on the hosts that hold it untags it; the next garbage collection
/// removes its layers, chunks and working set from the store and the caches, and leaves
/// another snapshot's alone.
fn deleting_a_snapshot_collects_its_layers() {
    let store = tempfile::tempdir().unwrap();
    let a_dir = data_dir_with_snapshot();
    let other = Tag::parse("other").unwrap();
    write_checksum_guest_snapshot(&a_dir.path().join("snapshots/other"), 32, 1, 7).unwrap();
    let no_grace = |cfg: HostConfig| {
        let mut cfg = with_store(cfg, store.path());
        cfg.store.as_mut().unwrap().gc_grace = Duration::ZERO;
        cfg
    };
    let a = Host::open(no_grace(config(a_dir.path(), 4, 0))).unwrap();
    let idle = a.publish(&tag()).unwrap();
    let kept = a.publish(&other).unwrap();
    let b_dir = tempfile::tempdir().unwrap();
    let b = Host::open(no_grace(config(b_dir.path(), 4, 0))).unwrap();
    b.ensure_local(&tag(), &idle.head).unwrap();
    let ws = store
        .path()
        .join(tine_host::lazy::working_set_key(&idle.head));
    std::fs::create_dir_all(ws.parent().unwrap()).unwrap();
    std::fs::write(&ws, tine_host::lazy::encode_working_set(&[1, 2])).unwrap();
    let in_store = |d: &tine_snapshot_store::Digest| {
        store
            .path()
            .join(tine_snapshot_store::cache::layer_key(d))
            .is_file()
    };
    // Still tagged: collection keeps everything.
    a.collect_garbage().unwrap();
    assert!(in_store(&idle.head) && in_store(&kept.head) && ws.is_file());

    assert!(a.delete_snapshot(&tag()).unwrap());
    assert!(b.delete_snapshot(&tag()).unwrap());
    let got = a.collect_garbage().unwrap().expect("a store");
    println!("  store: {:?}", got.store);
    assert!(!in_store(&idle.head), "its layer left the store");
    assert!(
        got.store.objects_deleted > 0 && got.store.side_objects_deleted == 1,
        "{got:?}"
    );
    assert!(!ws.exists(), "its working set went with it");
    assert!(in_store(&kept.head), "another snapshot's layer stays");
    let gb = b.collect_garbage().unwrap().expect("a store");
    println!("  cache of b: {:?}, images {}", gb.cache, gb.images);
    assert_eq!(gb.images, 1, "{gb:?}");
    let cached = std::fs::read_dir(b_dir.path().join("layers/layers"))
        .unwrap()
        .count();
    assert_eq!(cached, 0, "b's cache let the layer go");
    // The snapshot that stays still spawns on a host that never had it.
    let c_dir = tempfile::tempdir().unwrap();
    let c = Host::open(no_grace(config(c_dir.path(), 4, 0))).unwrap();
    assert!(c.ensure_local(&other, &kept.head).unwrap().is_some());
}

/// (span name, parent span name) as each span was created.
type SpanEdges = Vec<(String, Option<String>)>;

/// Records each new span's name with its parent's, across threads.
#[derive(Clone, Default)]
struct SpanTree(std::sync::Arc<Mutex<SpanEdges>>);

impl<S> tracing_subscriber::Layer<S> for SpanTree
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    fn on_new_span(
        &self,
        _: &tracing::span::Attributes<'_>,
        id: &tracing::span::Id,
        ctx: tracing_subscriber::layer::Context<'_, S>,
    ) {
        let span = ctx.span(id).expect("new span");
        let parent = span.parent().map(|p| p.name().to_string());
        self.0
            .lock()
            .unwrap()
            .push((span.name().to_string(), parent));
    }
}

/// The spawn phases are spans under the caller's span (the executor's request span, itself
/// joined to the control plane's trace), even though children are set up on other threads.
fn spawn_phases_are_spans_of_the_callers_trace() {
    use tracing_subscriber::layer::SubscriberExt;
    let tree = SpanTree::default();
    // Global: the host sets children up on threads of its own.
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(tree.clone()))
        .expect("first subscriber");
    let tmp = data_dir_with_snapshot();
    let host = Host::open_exclusive(config(tmp.path(), 4, 0)).unwrap();
    let request = tracing::info_span!("request");
    let outcomes = request.in_scope(|| spawn(&host, ids(2)));
    assert!(outcomes.iter().all(|o| o.result.is_ok()));
    let seen = tree.0.lock().unwrap().clone();
    let count = |name: &str, parent: &str| {
        seen.iter()
            .filter(|(n, p)| n == name && p.as_deref() == Some(parent))
            .count()
    };
    assert_eq!(count("spawn.child", "request"), 2, "{seen:?}");
    assert_eq!(count("spawn.handoff", "spawn.child"), 2, "{seen:?}");
    assert_eq!(count("spawn.restore", "spawn.child"), 2, "{seen:?}");
    host.kill_all();
}

fn spawn_of(host: &Host, tag: &Tag) -> SandboxId {
    spawn_with(host, tag, &SpawnOptions::default())
}

/// The whole counts a counter child printed (the first line may be cut where its snapshot
/// was taken, so it is skipped), waiting until there are at least `n`.
fn counts_of(host: &Host, id: &SandboxId, n: usize) -> Vec<u64> {
    let log = host.vm_dir(id).unwrap().join("console.log");
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let body = text.split_once('\n').map_or("", |(_, rest)| rest);
        let c = counts(body);
        if c.len() >= n {
            return c;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{id} printed {} counts, not {n}",
            c.len()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The parts of a restore its marks name, in order (`tine-vmm: restore CPU ms: ..`).
const RESTORE_STEPS: [&str; 12] = [
    "header",
    "state-read",
    "checksum",
    "decode",
    "chain",
    "ram",
    "vm",
    "device-wire",
    "device-make",
    "vcpus",
    "irqchip",
    "device-state",
];

/// The counter guest's snapshot under tag `counter` in `tmp`'s data directory, carrying page
/// lists: the working set `touched` and the written set `written`. Returns its directory.
fn counter_snapshot_with_page_lists(
    tmp: &tempfile::TempDir,
    touched: &[u64],
    written: &[u64],
) -> std::path::PathBuf {
    let snap = tmp.path().join("snapshots").join("counter");
    std::fs::create_dir_all(snap.parent().unwrap()).unwrap();
    write_counter_guest_snapshot(&snap, 32).unwrap();
    use tine_host::lazy::{save_page_list, WORKING_SET_FILE, WRITTEN_SET_FILE};
    save_page_list(&snap, WORKING_SET_FILE, touched).unwrap();
    save_page_list(&snap, WRITTEN_SET_FILE, written).unwrap();
    snap
}

/// A snapshot that carries a working set has its children map those pages before they run
/// (vmm.log says how); a damaged working set is ignored, never a failed spawn.
fn children_prefault_their_snapshot_s_working_set() {
    let tmp = tempfile::tempdir().unwrap();
    let tag = Tag::parse("counter").unwrap();
    let snap = counter_snapshot_with_page_lists(&tmp, &[257, 0, 1, 2, 256], &[256]);
    // Unprimed workers: each child maps the working set as it restores (the primed path is
    // idle_workers_prime_themselves_for_the_snapshot_spawned_from).
    let mut cfg = config(tmp.path(), 8, 1);
    cfg.limits.prime_workers = false;
    let host = Host::open_exclusive(cfg).unwrap();
    let log_of = |id: &SandboxId| {
        std::fs::read_to_string(tmp.path().join("vms").join(id.as_str()).join("vmm.log")).unwrap()
    };
    let c = spawn_of(&host, &tag);
    let counts = counts_of(&host, &c, 3);
    assert!(counts.windows(2).all(|w| w[1] == w[0] + 1), "{counts:?}");
    let log = log_of(&c);
    assert!(log.contains("prefaulted 5 pages in 2 runs ("), "{log}");
    assert!(log.contains("1 copied ahead"), "{log}");
    assert!(!log.contains("(none)"), "some method mapped them: {log}");
    // The worker's main thread says where its CPU went, step by step (before its report).
    // And its page faults, the same steps (whole numbers); then the restore's own parts.
    let worker_steps = [
        "main",
        "ahead",
        "job",
        "view",
        "restore",
        "prefault",
        "lock-down",
        "start",
    ];
    let restore_steps = RESTORE_STEPS;
    // The view's and the lock-down's parts (a worker confined as by default: its own user,
    // its view).
    let view_steps = [
        "session",
        "linked",
        "netns",
        "namespace",
        "root",
        "binds",
        "proc",
        "kvm-linked",
        "pivot",
        "seal",
    ];
    let lock_steps = ["filters", "user", "thread", "seccomp"];
    for (prefix, whole, expected) in [
        ("tine-vmm: view CPU ms: ", false, &view_steps[..]),
        ("tine-vmm: lock-down CPU ms: ", false, &lock_steps[..]),
        ("tine-vmm: lock-down page faults: ", true, &lock_steps[..]),
        ("tine-vmm: main thread CPU ms: ", false, &worker_steps[..]),
        (
            "tine-vmm: main thread page faults: ",
            true,
            &worker_steps[..],
        ),
        ("tine-vmm: restore CPU ms: ", false, &restore_steps[..]),
        ("tine-vmm: restore page faults: ", true, &restore_steps[..]),
    ] {
        let marks = log
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} in: {log}"));
        let steps: Vec<(&str, &str)> = marks
            .split(", ")
            .filter_map(|s| s.split_once(' '))
            .collect();
        assert_eq!(
            steps.iter().map(|(step, _)| *step).collect::<Vec<_>>(),
            expected,
            "{log}"
        );
        for (step, v) in &steps {
            let parsed = if whole {
                v.parse::<u64>().is_ok()
            } else {
                v.parse::<f64>().is_ok()
            };
            assert!(parsed, "{step} {v:?}: {log}");
        }
    }

    // Truncated: no prefault, and the child runs as before.
    let ws = snap.join(tine_host::lazy::WORKING_SET_FILE);
    let bytes = std::fs::read(&ws).unwrap();
    std::fs::write(&ws, &bytes[..bytes.len() - 3]).unwrap();
    let d = spawn_of(&host, &tag);
    let counts = counts_of(&host, &d, 2);
    assert!(counts[1] == counts[0] + 1, "{counts:?}");
    assert!(!log_of(&d).contains("prefaulted"), "{}", log_of(&d));
    host.kill_all();
}

/// Idle workers prime themselves for the snapshot last spawned from (its restore up to what
/// needs the child, its working set mapped); a child handed one runs as any other. A worker
/// primed for a snapshot replaced since restores the new one from the start, and deleting
/// the snapshot ends the workers primed for it.
fn idle_workers_prime_themselves_for_the_snapshot_spawned_from() {
    let (tmp, tag) = counter_snapshot();
    let snap = tmp.path().join("snapshots").join("counter");
    use tine_host::lazy::{save_page_list, WORKING_SET_FILE, WRITTEN_SET_FILE};
    save_page_list(&snap, WORKING_SET_FILE, &[257, 0, 1, 2, 256]).unwrap();
    save_page_list(&snap, WRITTEN_SET_FILE, &[256]).unwrap();
    let host = Host::open_exclusive(config(tmp.path(), 8, 2)).unwrap();
    let log_of = |id: &SandboxId| {
        std::fs::read_to_string(tmp.path().join("vms").join(id.as_str()).join("vmm.log")).unwrap()
    };
    let steps_of = |log: &str, prefix: &str| -> Vec<String> {
        let marks = log
            .lines()
            .find_map(|l| l.strip_prefix(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} in: {log}"));
        marks
            .split(", ")
            .filter_map(|s| s.split_once(' '))
            .map(|(step, _)| step.to_string())
            .collect()
    };
    let wait_primed = |n: usize| {
        let t0 = Instant::now();
        while host.primed_workers(&tag) < n {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{} of {n} workers primed",
                host.primed_workers(&tag)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    // The first child finds no primed worker; the pool primes its refills for the snapshot.
    let first = spawn_of(&host, &tag);
    assert!(counts_of(&host, &first, 2)
        .windows(2)
        .all(|w| w[1] == w[0] + 1));
    assert!(
        !steps_of(&log_of(&first), "tine-vmm: main thread CPU ms: ").contains(&"prime".to_string())
    );
    wait_primed(2);

    let c = spawn_of(&host, &tag);
    let counts = counts_of(&host, &c, 3);
    assert!(counts.windows(2).all(|w| w[1] == w[0] + 1), "{counts:?}");
    let log = log_of(&c);
    assert!(log.contains("prefaulted 5 pages in 2 runs ("), "{log}");
    assert!(log.contains("1 copied ahead"), "{log}");
    // Primed before its job, so no prefault after it; the restore's parts all there.
    assert_eq!(
        steps_of(&log, "tine-vmm: main thread CPU ms: "),
        [
            "main",
            "ahead",
            "prime",
            "job",
            "view",
            "restore",
            "lock-down",
            "start"
        ],
        "{log}"
    );
    assert_eq!(
        steps_of(&log, "tine-vmm: restore CPU ms: "),
        RESTORE_STEPS,
        "{log}"
    );
    // Served by its priming; its console is its own (the counts above), not the placeholder.
    assert!(!log.contains("restored from the start"), "{log}");
    // It primed from the host's path and runs in its view: its diff names the parent as the
    // view shows it, and a child of that diff counts on from the branch.
    let mid = Tag::parse("primed-mid").unwrap();
    let b = host.branch(&c, &mid, BranchKind::Diff).unwrap();
    assert_eq!(b.parent, tag);
    let from_b = spawn_of(&host, &mid);
    assert!(counts_of(&host, &from_b, 1)[0] > counts[2]);
    host.kill_all();
    assert!(host.delete_snapshot(&mid).unwrap());
    // The counter snapshot hot again.
    spawn_of(&host, &tag);

    // Replaced under the same name behind the host's back (written anew, renamed into
    // place): a primed worker sees new files and restores them from the start.
    wait_primed(2);
    let new = tmp.path().join("snapshots").join(".new-counter");
    write_counter_guest_snapshot(&new, 32).unwrap();
    let old = tmp.path().join("snapshots").join(".old-counter");
    std::fs::rename(&snap, &old).unwrap();
    std::fs::rename(&new, &snap).unwrap();
    let d = spawn_of(&host, &tag);
    let counts = counts_of(&host, &d, 2);
    assert!(counts[1] == counts[0] + 1, "{counts:?}");
    let log = log_of(&d);
    assert!(
        log.contains("but the snapshot was replaced since: restored from the start"),
        "{log}"
    );
    assert!(
        !log.contains("prefaulted"),
        "the new one has no working set: {log}"
    );
    std::fs::remove_dir_all(&old).unwrap();

    // Deleting it ends the idle workers primed for it (they hold its files open).
    host.kill_all();
    assert!(host.delete_snapshot(&tag).unwrap());
    assert_eq!(host.primed_workers(&tag), 0);
}

/// A data directory holding the counter guest's snapshot, tagged `counter`.
fn counter_snapshot() -> (tempfile::TempDir, Tag) {
    let tmp = tempfile::tempdir().unwrap();
    let snaps = tmp.path().join("snapshots");
    std::fs::create_dir_all(&snaps).unwrap();
    write_counter_guest_snapshot(&snaps.join("counter"), 32).unwrap();
    (tmp, Tag::parse("counter").unwrap())
}

/// The VMM process of child `id`.
fn pid_of(host: &Host, id: &SandboxId) -> u32 {
    host.list()
        .into_iter()
        .find(|v| v.record.id == *id)
        .expect("listed")
        .record
        .process
        .pid
}

/// Restores `run` to what it held when dropped.
struct KsmRunGuard(Option<String>);

impl Drop for KsmRunGuard {
    fn drop(&mut self) {
        if let Some(v) = &self.0 {
            let _ = std::fs::write(tine_host::ksm::RUN, v);
        }
    }
}

/// The VmFlags of each guest-RAM mapping in `pid`'s smaps.
fn guest_ram_flags(pid: u32) -> Vec<String> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let mut out = Vec::new();
    let mut in_ram = false;
    for l in smaps.lines() {
        let first = l.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            let path = l.split_whitespace().nth(5).unwrap_or("");
            in_ram = tine_host::hot::is_guest_ram(path);
        } else if let Some(flags) = l.strip_prefix("VmFlags:") {
            if in_ram {
                out.push(flags.trim().to_string());
            }
        }
    }
    out
}

/// Page merging: refused with the reason while the KSM daemon is stopped; with it running,
/// a child's guest RAM is advised mergeable (its mappings carry `mg`) and vmm.log says so.
/// As root it starts the daemon for this test (host-wide: other mergeable memory on the
/// machine may merge meanwhile, and stays merged) and puts the setting back.
fn children_guest_ram_is_open_to_page_merging() {
    let (tmp, tag) = counter_snapshot();
    let mut cfg = config(tmp.path(), 8, 1);
    cfg.limits.merge_pages = true;
    let run = std::fs::read_to_string(tine_host::ksm::RUN).unwrap_or_default();
    if run.trim() != "1" {
        let e = Host::open_exclusive(cfg.clone()).err().expect("refused");
        assert!(matches!(e, tine_host::HostError::PageMerging(_)), "{e}");
        assert!(e.to_string().contains("echo 1 >"), "{e}");
    }
    let _guard = match run.trim() {
        "1" => KsmRunGuard(None),
        _ if std::fs::write(tine_host::ksm::RUN, "1").is_ok() => KsmRunGuard(Some(run.clone())),
        _ => {
            println!(
                "  (KSM cannot be started here, absent or not root: only the refusal was checked)"
            );
            return;
        }
    };
    let host = Host::open_exclusive(cfg).unwrap();
    let c = spawn_of(&host, &tag);
    let counts = counts_of(&host, &c, 3);
    assert!(counts.windows(2).all(|w| w[1] == w[0] + 1), "{counts:?}");
    let log =
        std::fs::read_to_string(tmp.path().join("vms").join(c.as_str()).join("vmm.log")).unwrap();
    assert!(
        log.contains("guest RAM open to page merging (KSM)"),
        "{log}"
    );
    let pid = pid_of(&host, &c);
    let flags = guest_ram_flags(pid);
    assert!(!flags.is_empty(), "no guest RAM mapping in {pid}'s smaps");
    assert!(
        flags
            .iter()
            .all(|f| f.split_whitespace().any(|w| w == "mg")),
        "{flags:?}"
    );
    host.kill_all();
}

/// A snapshot's memory held by the host: a child restores from the copy (its guest RAM maps
/// the memfd, not memory.img) and runs; deleting the snapshot lets go of the copy.
fn children_restore_from_a_held_image() {
    let (tmp, tag) = counter_snapshot();
    let host = Host::open_exclusive(config(tmp.path(), 8, 1)).unwrap();
    let bytes = host.hold_image(&tag).unwrap();
    assert!(bytes > 0);
    assert_eq!(host.held_images().len(), 1);
    let c = spawn_of(&host, &tag);
    let counts = counts_of(&host, &c, 5);
    assert!(
        counts.windows(2).all(|w| w[1] == w[0] + 1),
        "it counts on: {counts:?}"
    );
    let maps_of = |id: &SandboxId| {
        std::fs::read_to_string(format!("/proc/{}/maps", pid_of(&host, id))).unwrap()
    };
    let maps = maps_of(&c);
    assert!(maps.contains("/memfd:tine-hot-image"), "{maps}");
    assert!(!maps.contains("memory.img"), "{maps}");

    // Such a child branches like any other, as a diff and in full; children of the diff map
    // the same held copy of the root under it, and carry on from the branch.
    let d = Tag::parse("d").unwrap();
    host.branch(&c, &d, BranchKind::Diff).unwrap();
    let f = Tag::parse("f").unwrap();
    host.branch(&c, &f, BranchKind::Full).unwrap();
    let from_d = spawn_of(&host, &d);
    assert!(counts_of(&host, &from_d, 1)[0] > counts[0]);
    let maps = maps_of(&from_d);
    assert!(maps.contains("/memfd:tine-hot-image"), "{maps}");
    let from_f = spawn_of(&host, &f);
    assert!(counts_of(&host, &from_f, 1)[0] > counts[0]);
    host.kill_all();
    assert!(host.delete_snapshot(&d).unwrap());
    assert!(host.delete_snapshot(&f).unwrap());
    assert!(host.delete_snapshot(&tag).unwrap());
    assert!(
        !host
            .held_images()
            .iter()
            .any(|(p, _)| p.ends_with("counter/memory.img")),
        "{:?}",
        host.held_images()
    );
}

/// A child's VMM gives back, once, the guest RAM pages it holds as the snapshot has them (here
/// two pages copied ahead with the written set that the guest never changes), keeps the page
/// it changed (the counter's), and the guest runs on through the pause.
fn children_give_back_pages_they_hold_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let tag = Tag::parse("counter").unwrap();
    let counter_page = tine_host::testing::COUNTER / 4096;
    let snap =
        counter_snapshot_with_page_lists(&tmp, &[0, 1, 2, 256, 300, counter_page], &[256, 300]);
    let mut cfg = config(tmp.path(), 8, 1);
    cfg.limits.give_back_after = Some(Duration::from_millis(1500));
    let host = Host::open_exclusive(cfg).unwrap();
    let c = spawn_of(&host, &tag);
    let pid = host
        .list()
        .into_iter()
        .find(|v| v.record.id == c)
        .unwrap()
        .record
        .process
        .pid;
    let image = snap.join(tine_vmm::snapshot::file::MEMORY_FILE);
    let written = || tine_host::pagemap::written_pages(pid, &image).unwrap();
    // Counting: it has written its counter's page.
    counts_of(&host, &c, 2);
    let before = written();
    for p in [256, 300, counter_page] {
        assert!(
            before.contains(&p),
            "page {p} held privately at first: {before:?}"
        );
    }
    let log = host.vm_dir(&c).unwrap().join("vmm.log");
    let t0 = Instant::now();
    let line = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if let Some(l) = text.lines().find(|l| l.contains("tine-vmm: gave back")) {
            break l.to_string();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no give-back in vmm.log:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    println!("     {line}");
    let after = written();
    assert!(
        !after.contains(&256) && !after.contains(&300),
        "the unchanged pages map the image again: {after:?}"
    );
    assert!(after.contains(&counter_page), "{after:?}");
    let given: u64 = line
        .split_whitespace()
        .nth(3)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"));
    assert!(given >= 2, "{line}");
    // The guest counts on, one by one, through the pause.
    let at = counts_of(&host, &c, 1).len();
    let counts = counts_of(&host, &c, at + 5);
    assert!(counts.windows(2).all(|w| w[1] == w[0] + 1), "{counts:?}");
    assert!(host.kill(&c).unwrap());
}

/// A child's VMM serves its control socket and waits for its guest on one thread: a guest
/// that asks for a reset after a while answers a control request while it runs, then its VMM
/// ends with the guest's code (a reset's, 2) and the host reaps it with that reason.
fn a_guest_that_stops_ends_its_vmm() {
    let tmp = tempfile::tempdir().unwrap();
    let snaps = tmp.path().join("snapshots");
    std::fs::create_dir_all(&snaps).unwrap();
    // Seconds at any clock rate: a child lives for what its parent left of them.
    write_stopping_counter_guest_snapshot(&snaps.join("stopping"), 32, 20_000_000_000).unwrap();
    let host = Host::open_exclusive(config(tmp.path(), 8, 0)).unwrap();
    let t0 = Instant::now();
    let id = spawn_of(&host, &Tag::parse("stopping").unwrap());
    let first = counts_of(&host, &id, 1)[0];
    assert!(
        first < 40,
        "the child starts near the parent's count (3), not {first}"
    );
    let counters = host
        .kvm_counters(&id)
        .expect("a running child answers on its control socket")
        .expect("this host's KVM keeps counters");
    assert!(counters.0.contains_key("exits"), "{counters:?}");
    let ended = loop {
        if let Some(e) = host.reap().into_iter().find(|e| e.id == id) {
            break e;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "the child's guest never stopped"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    println!(
        "     ended after {:.1} s: {}",
        t0.elapsed().as_secs_f64(),
        ended.reason.lines().next().unwrap_or("")
    );
    assert!(ended.reason.contains("exit status: 2"), "{}", ended.reason);
    assert!(!ended.out_of_memory);
    assert!(host.live_ids().is_empty());
}

/// Branch running children: a diff holds only what the child wrote and carries its state
/// (its children count on from the branch, not from the root), the source runs on, a branch
/// of a branch works, a full branch stands alone, a re-adopted child can be branched, and
/// bad requests and deleting a parent under its branches are refused.
fn branching_running_children() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Tag::parse("counter").unwrap();
    let snaps = tmp.path().join("snapshots");
    std::fs::create_dir_all(&snaps).unwrap();
    write_counter_guest_snapshot(&snaps.join("counter"), 32).unwrap();
    let host = Host::open_exclusive(config(tmp.path(), 8, 1)).unwrap();

    let c1 = spawn_of(&host, &root);
    let at_root = counts_of(&host, &c1, 1)[0];
    let before = *counts_of(&host, &c1, 10).last().unwrap();
    let b1 = Tag::parse("b1").unwrap();
    let b = host.branch(&c1, &b1, BranchKind::Diff).unwrap();
    assert_eq!(b.parent, root);
    let d = b.header.diff.as_ref().expect("a diff");
    assert_eq!(d.parent, "counter");
    // The counter's page (and little else: no stack, no devices) was written since the fork.
    assert!((1..16).contains(&b.pages_written), "{b:?}");
    assert_eq!(d.pages, b.pages_written);
    assert!(b.paused <= b.took);
    // The source is now a diff over its branch: its next branch holds only what changes.
    let r = b.rebase.expect("rebased onto b1");
    assert_eq!(
        r.counts.pages_mapped + r.counts.pages_kept,
        b.pages_written,
        "{r:?}"
    );
    // The source carries on.
    let n = counts_of(&host, &c1, 0).len();
    counts_of(&host, &c1, n + 5);

    // Live: the same diff, its pages copied after the child resumed.
    let l1 = Tag::parse("l1").unwrap();
    let live = host.branch(&c1, &l1, BranchKind::Live).unwrap();
    assert_eq!(live.parent, b1);
    assert_eq!(live.header.diff.as_ref().unwrap().parent, "b1");
    assert!(live.pages_written >= 1);
    assert!(live.rebase.is_some());
    let gl = spawn_of(&host, &l1);
    assert!(counts_of(&host, &gl, 1)[0] > before);

    // A child of the branch counts on from the branch's instant.
    let g1 = spawn_of(&host, &b1);
    let first = counts_of(&host, &g1, 1)[0];
    assert!(
        first > before && first > at_root + 5,
        "the branch's child starts at {first}; the source was at {before} before the branch"
    );

    // A branch of a branch (a diff over a diff), and a full branch.
    let later = *counts_of(&host, &g1, 5).last().unwrap();
    let b2 = Tag::parse("b2").unwrap();
    let deeper = host.branch(&g1, &b2, BranchKind::Diff).unwrap();
    assert_eq!(deeper.parent, b1);
    assert_eq!(deeper.header.diff.as_ref().unwrap().parent, "b1");
    let g2 = spawn_of(&host, &b2);
    assert!(counts_of(&host, &g2, 1)[0] > later);
    let f1 = Tag::parse("f1").unwrap();
    let full = host.branch(&g1, &f1, BranchKind::Full).unwrap();
    assert!(full.header.diff.is_none());
    assert!(full.dir.join("memory.img").is_file());
    let g3 = spawn_of(&host, &f1);
    assert!(counts_of(&host, &g3, 1)[0] > later);

    // Refused: an unknown VM, a tag in use, deleting or replacing a parent under its branches.
    let e = host
        .branch(
            &SandboxId::random("nobody"),
            &Tag::parse("x").unwrap(),
            BranchKind::Diff,
        )
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let e = host.branch(&c1, &b1, BranchKind::Diff).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    let e = host.delete_snapshot(&root).unwrap_err();
    assert!(
        e.to_string().contains("has descendants on this host (b1"),
        "{e}"
    );
    assert_eq!(e.kind(), ErrorKind::Precondition);
    assert!(!host
        .snapshot_tags()
        .iter()
        .any(|t| t.as_str().starts_with('.')));

    // After a restart, an adopted child is branched through its control socket.
    drop(host);
    let host = Host::open_exclusive(config(tmp.path(), 8, 1)).unwrap();
    let b3 = Tag::parse("b3").unwrap();
    assert_eq!(host.branch(&c1, &b3, BranchKind::Diff).unwrap().parent, l1);
    let g4 = spawn_of(&host, &b3);
    assert!(counts_of(&host, &g4, 1)[0] > before);

    host.kill_all();
    for t in [&b2, &b3, &l1, &b1, &f1, &root] {
        assert!(host.delete_snapshot(t).unwrap(), "{t}");
    }
    let _ = (g2, g3, gl);
}

fn spawn_with(host: &Host, tag: &Tag, opts: &SpawnOptions) -> SandboxId {
    let id = SandboxId::random("t");
    let out = Mutex::new(Vec::new());
    host.spawn(tag, vec![id.clone()], opts, |o| out.lock().unwrap().push(o))
        .unwrap();
    let o = out.into_inner().unwrap().pop().unwrap();
    o.result.expect("child ready");
    id
}

/// A branch made on a host with a store becomes a diff layer over its parent's layer: only its
/// pages travel, and another host forks it (eagerly or lazily) from that instant.
fn a_branch_is_a_diff_layer_other_hosts_fork() {
    let store = tempfile::tempdir().unwrap();
    let a_dir = tempfile::tempdir().unwrap();
    let snaps = a_dir.path().join("snapshots");
    std::fs::create_dir_all(&snaps).unwrap();
    write_counter_guest_snapshot(&snaps.join("counter"), 32).unwrap();
    let root = Tag::parse("counter").unwrap();
    let a = Host::open(with_store(config(a_dir.path(), 4, 0), store.path())).unwrap();
    let base = a.publish(&root).unwrap();
    let c = spawn_of(&a, &root);
    let before = *counts_of(&a, &c, 10).last().unwrap();
    let mid = Tag::parse("mid").unwrap();
    let b = a.branch(&c, &mid, BranchKind::Diff).unwrap();
    let layer = b.layer.expect("published");
    assert_eq!(layer.parent, Some(base.head));
    assert_eq!(layer.chain, vec![layer.head, base.head]);
    // What the diff layer stores is the branch's pages, not another image.
    assert!(
        layer.raw_bytes - base.raw_bytes <= b.pages_written * 4096,
        "{layer:?}"
    );
    a.kill_all();

    for fetch in [FetchMode::Eager, FetchMode::Lazy { prefetch: true }] {
        let h_dir = tempfile::tempdir().unwrap();
        let h = Host::open(with_fetch(
            with_store(config(h_dir.path(), 4, 0), store.path()),
            fetch,
        ))
        .unwrap();
        let g = spawn_with(
            &h,
            &mid,
            &SpawnOptions {
                layer: Some(layer.head),
                ..SpawnOptions::default()
            },
        );
        let first = counts_of(&h, &g, 1)[0];
        assert!(
            first > before,
            "{fetch:?}: the branch's child starts at {first}, before {before}"
        );
        h.kill_all();
    }
}

/// A source killed while it is being branched: the branch either fails (and no snapshot of
/// that tag appears, whole or partial) or completes and restores; nothing in between.
fn a_source_killed_mid_branch_leaves_a_whole_snapshot_or_none() {
    let tmp = tempfile::tempdir().unwrap();
    let snaps = tmp.path().join("snapshots");
    std::fs::create_dir_all(&snaps).unwrap();
    write_counter_guest_snapshot(&snaps.join("counter"), 64).unwrap();
    let root = Tag::parse("counter").unwrap();
    let host = Host::open_exclusive(config(tmp.path(), 8, 1)).unwrap();
    let (mut failed, mut made) = (0, 0);
    for i in 0..9u64 {
        let c = spawn_of(&host, &root);
        let tag = Tag::parse(format!("k{i}")).unwrap();
        let kind = [BranchKind::Full, BranchKind::Diff, BranchKind::Live][i as usize % 3];
        let r = std::thread::scope(|s| {
            let b = s.spawn(|| host.branch(&c, &tag, kind));
            std::thread::sleep(Duration::from_millis(2 * i));
            host.kill(&c).unwrap();
            b.join().unwrap()
        });
        match r {
            Ok(_) => {
                made += 1;
                let g = spawn_of(&host, &tag);
                host.kill(&g).unwrap();
            }
            Err(e) => {
                failed += 1;
                println!("     {kind:?} killed after {} ms: {e}", 2 * i);
                assert!(!host.snapshot_dir(&tag).exists(), "{e}");
            }
        }
        assert!(!host
            .snapshot_tags()
            .iter()
            .any(|t| t.as_str().starts_with('.')));
    }
    println!("     {made} branches completed before the kill, {failed} failed cleanly");
    // Whatever a killed writer left beside the snapshots is swept at the next start.
    let left = snaps.join("..partial-branch-x.tmp-1");
    std::fs::create_dir_all(&left).unwrap();
    std::fs::write(left.join("pages.bin"), b"half").unwrap();
    let old = std::time::SystemTime::now() - Duration::from_secs(7200);
    std::fs::File::open(&left)
        .unwrap()
        .set_modified(old)
        .unwrap();
    drop(host);
    let host = Host::open_exclusive(config(tmp.path(), 8, 1)).unwrap();
    assert!(!left.exists());
    host.kill_all();
}

/// A tmpfs of `mib` MiB mounted at `at` for the life of the guard (None without the right to
/// mount: not root).
struct SmallDisk(std::ffi::CString);

impl SmallDisk {
    fn mount(at: &Path, mib: u64) -> Option<SmallDisk> {
        use std::os::unix::ffi::OsStrExt;
        let target = std::ffi::CString::new(at.as_os_str().as_bytes()).unwrap();
        let opts = std::ffi::CString::new(format!("size={mib}m,mode=0700")).unwrap();
        // SAFETY: valid NUL-terminated strings; mount has no memory-safety preconditions.
        let rc = unsafe {
            libc::mount(
                c"tmpfs".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                opts.as_ptr().cast(),
            )
        };
        (rc == 0).then_some(SmallDisk(target))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        // SAFETY: a NUL-terminated path; a lazy unmount also works with files still open.
        unsafe { libc::umount2(self.0.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Fill the file system under `dir` until a write fails; the filler's path.
fn fill(dir: &Path) -> std::path::PathBuf {
    use std::io::Write;
    let path = dir.join("filler");
    let mut f = std::fs::File::create(&path).unwrap();
    let block = vec![0xa5u8; 64 << 10];
    while f.write_all(&block).is_ok() {}
    let small = [0x5au8; 512];
    while f.write_all(&small).is_ok() {}
    path
}

/// The snapshots' disk full while a running child is branched: each kind fails with the
/// reason, leaves no snapshot and no staging behind, and the child runs on; with room again
/// the same branch succeeds.
fn a_full_disk_fails_the_branch_and_keeps_the_source() {
    let tmp = tempfile::tempdir().unwrap();
    let snaps = tmp.path().join("snapshots");
    std::fs::create_dir_all(&snaps).unwrap();
    let Some(_disk) = SmallDisk::mount(&snaps, 80) else {
        println!("     SKIPPED: mounting a small tmpfs needs root");
        return;
    };
    write_counter_guest_snapshot(&snaps.join("counter"), 32).unwrap();
    let root = Tag::parse("counter").unwrap();
    let host = Host::open_exclusive(config(tmp.path(), 8, 1)).unwrap();
    let c = spawn_of(&host, &root);
    counts_of(&host, &c, 3);
    let filler = fill(&snaps);
    for (i, kind) in [BranchKind::Full, BranchKind::Diff, BranchKind::Live]
        .into_iter()
        .enumerate()
    {
        let tag = Tag::parse(format!("full{i}")).unwrap();
        let e = host.branch(&c, &tag, kind).unwrap_err();
        println!("     {kind:?} on a full disk: {e}");
        assert!(
            format!("{e:#}").contains("No space left on device"),
            "{kind:?}: {e:#}"
        );
        assert!(!host.snapshot_dir(&tag).exists());
        let left: Vec<_> = std::fs::read_dir(&snaps)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(left.is_empty(), "{kind:?} left {left:?}");
        // The source runs on.
        let n = counts_of(&host, &c, 0).len();
        counts_of(&host, &c, n + 3);
    }
    std::fs::remove_file(&filler).unwrap();
    let tag = Tag::parse("roomy").unwrap();
    let before = *counts_of(&host, &c, 0).last().unwrap();
    host.branch(&c, &tag, BranchKind::Live).unwrap();
    let g = spawn_of(&host, &tag);
    assert!(counts_of(&host, &g, 1)[0] > before);
    host.kill_all();
}

/// Fields of /proc/PID/status (or a task's), by name.
fn proc_status(path: &Path) -> std::collections::HashMap<String, String> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_string(), v.trim().to_string()))
        .collect()
}

/// Each VMM worker runs as a user of its own with no capabilities, behind a seccomp filter,
/// in a file system holding only its directory, its snapshots, /dev/kvm and /proc; a branch
/// still works, and comes back owned by the host. A worker that makes a call outside its
/// allow-list dies with SIGSYS and its spawn fails saying which call.
fn vmm_workers_are_confined() {
    let tmp = data_dir_with_snapshot();
    let host = Host::open_exclusive(config(tmp.path(), 4, 0)).unwrap();
    host.check_confinement()
        .expect("a worker confines itself on this host");
    let out = spawn(&host, ids(1));
    out[0].result.as_ref().expect("spawned");
    let id = out[0].id.clone();
    let pid = out[0].pid.expect("a pid");
    let uid = (tine_host::confine::DEFAULT_UID_BASE + pid).to_string();
    let proc = std::path::PathBuf::from(format!("/proc/{pid}"));
    let own_filters: u32 = proc_status(std::path::Path::new("/proc/self/status"))
        ["Seccomp_filters"]
        .parse()
        .unwrap();
    let mut threads = Vec::new();
    for task in std::fs::read_dir(proc.join("task")).unwrap() {
        let st = proc_status(&task.unwrap().path().join("status"));
        let name = &st["Name"];
        println!(
            "     {name:<16} Uid {:<40} CapEff {} CapBnd {} NoNewPrivs {} Seccomp {} filters {}",
            st["Uid"],
            st["CapEff"],
            st["CapBnd"],
            st["NoNewPrivs"],
            st["Seccomp"],
            st["Seccomp_filters"]
        );
        assert_eq!(
            st["Uid"].split_whitespace().collect::<Vec<_>>(),
            [uid.as_str(); 4],
            "{name}"
        );
        assert_eq!(
            st["Gid"].split_whitespace().collect::<Vec<_>>(),
            [uid.as_str(); 4],
            "{name}"
        );
        assert_eq!(st["Groups"], "", "{name}");
        for caps in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(st[caps], "0000000000000000", "{name} {caps}");
        }
        assert_eq!(st["NoNewPrivs"], "1", "{name}");
        assert_eq!(st["Seccomp"], "2", "{name}");
        // One program (the refusals spliced into the allow-list), on top of what the executor
        // itself runs under.
        assert_eq!(
            st["Seccomp_filters"].parse::<u32>().unwrap(),
            own_filters + 1,
            "{name}"
        );
        threads.push(name.clone());
    }
    assert!(
        threads.len() >= 2 && threads.iter().any(|n| n.starts_with("vcpu")),
        "the main thread and a vCPU at least: {threads:?}"
    );
    // Its KVM counters still come through the control socket once it is locked down (the
    // statistics files were opened before).
    let counters = host
        .kvm_counters(&id)
        .expect("a confined VMM answers for its counters")
        .expect("this host's KVM keeps counters");
    // (This guest spins without leaving, so the values may all be 0: the names are the check.)
    assert!(counters.0.contains_key("exits"), "{counters:?}");
    assert!(counters.0.contains_key("vm.pages_4k"), "{counters:?}");
    let mut seen: Vec<String> = std::fs::read_dir(proc.join("root"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    seen.sort();
    assert_eq!(
        seen,
        ["dev", "proc", "snapshots", "vm"],
        "its whole file system"
    );
    // Its /proc is a procfs of its own that shows it its own process alone, nothing host-wide.
    let mountinfo = std::fs::read_to_string(proc.join("mountinfo")).unwrap();
    let procfs = mountinfo
        .lines()
        .find(|l| l.split_whitespace().nth(4) == Some("/proc"))
        .expect("a /proc mount");
    println!("     its /proc: {procfs}");
    assert!(
        procfs.contains(" - proc ")
            && procfs.contains("hidepid=invisible")
            && procfs.contains("subset=pid"),
        "{procfs}"
    );
    assert!(!proc.join("root/proc/sys").exists());
    assert!(!proc.join("root/proc/cpuinfo").exists());
    assert!(proc.join(format!("root/proc/{pid}/pagemap")).exists());
    let b = host
        .branch(&id, &Tag::parse("conf1").unwrap(), BranchKind::Diff)
        .unwrap();
    use std::os::unix::fs::MetadataExt;
    for f in std::fs::read_dir(&b.dir).unwrap() {
        let m = f.unwrap().metadata().unwrap();
        assert_eq!(
            (m.uid(), m.mode() & 0o777),
            (0, 0o644),
            "the host's, read-only"
        );
    }
    host.kill_all();
    drop(host);

    let mut cfg = config(tmp.path(), 4, 0);
    cfg.confine.trip_seccomp = true;
    let host = Host::open_exclusive(cfg).unwrap();
    // The check at start fails the same way, saying why, and leaves nothing behind.
    let err = host.check_confinement().expect_err("its probe died");
    println!("     the check at start: {err}");
    assert!(matches!(err, HostError::Unconfined { .. }), "{err:?}");
    assert!(err.to_string().contains("system call 101"), "{err}");
    assert_eq!(
        std::fs::read_dir(tmp.path().join("vms")).unwrap().count(),
        0,
        "its directory is removed"
    );
    let out = spawn(&host, ids(1));
    let err = out[0].result.as_ref().expect_err("the worker died");
    println!("     a worker outside its allow-list: {err}");
    assert!(
        err.to_string()
            .contains("seccomp: system call 101 is outside this VMM's allow-list"),
        "{err}"
    );
    assert!(host.live_ids().is_empty());
}

/// An image directory whose kernel is `kernel` (bytes) beside an empty initrd.
fn image_with_kernel(dir: &Path, kernel: &[u8]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("vmlinux"), kernel).unwrap();
    std::fs::write(dir.join("initrd"), b"").unwrap();
    let file = |path: &str, bytes: usize| tine_image::manifest::FileInfo {
        path: path.into(),
        sha256: String::new(),
        bytes: bytes as u64,
    };
    let m = tine_image::ImageManifest {
        format: tine_image::manifest::FORMAT,
        id: "test".into(),
        recipe: "test".into(),
        content_hash: String::new(),
        kernel: file("vmlinux", kernel.len()),
        kernel_package: String::new(),
        kernel_version: String::new(),
        kernel_release: String::new(),
        initrd: file("initrd", 0),
        compression: tine_image::Compression::Zstd,
        cmdline_append: String::new(),
        memory_mib: 32,
        warmup: String::new(),
        agent: tine_image::manifest::AgentInfo {
            guest_path: "/init".into(),
            config_path: String::new(),
            config: String::new(),
            sha256: String::new(),
            modules: Vec::new(),
            module_files: Vec::new(),
        },
        rootfs: Default::default(),
        inputs: serde_json::Value::Null,
        built_unix: 0,
        build_seconds: 0.0,
        dir: dir.to_path_buf(),
    };
    std::fs::write(dir.join("image.json"), m.to_json()).unwrap();
}

/// A parent boots in a confined VMM worker, which reads its kernel inside its view: a kernel
/// it cannot load fails the snapshot with the VMM's own reason, and leaves no worker, no
/// record, no directory and no partial snapshot behind.
fn a_parent_that_cannot_boot_fails_with_its_vmm_s_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let image = tmp.path().join("image");
    image_with_kernel(&image, &[0x5a; 8192]);
    let host = Host::open_exclusive(config(tmp.path(), 4, 0)).unwrap();
    let spec = tine_host::ParentSpec {
        image: tine_image::ImageRef::Local(image.to_string_lossy().into_owned()),
        tag: Tag::parse("broken").unwrap(),
        vcpus: 1,
        mem_mib: Some(32),
        evals: Vec::new(),
        ready_timeout: Some(Duration::from_secs(30)),
        replace: false,
    };
    let t0 = Instant::now();
    let err = host.create_snapshot(&spec).expect_err("a kernel of junk");
    println!("     {err} (after {:?})", t0.elapsed());
    assert!(matches!(err, HostError::ParentBootFailed { .. }), "{err:?}");
    assert!(err.to_string().contains("kernel"), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "not a timeout");
    let left: Vec<String> = ["vms", "snapshots"]
        .iter()
        .flat_map(|d| std::fs::read_dir(tmp.path().join(d)).into_iter().flatten())
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    assert!(host.list().is_empty());
    assert_eq!(host.idle_workers(), 0, "the worker was taken and ended");
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(BYSTANDER) {
        // A process that is not a VMM worker: wait until stdin closes.
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
        return;
    }
    if args.get(1).map(String::as_str) == Some(WORKER_SUBCOMMAND) {
        let code = match tine_host::worker_main() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("worker: {e:#}");
                1
            }
        };
        std::process::exit(code);
    }
    if !kvm_available() {
        println!("SKIPPED: /dev/kvm is absent or not usable; the host tests need KVM");
        return;
    }
    let filter = args.iter().skip(1).find(|a| !a.starts_with('-')).cloned();
    let tests: [(&str, fn()); 32] = [
        (
            "a_zygote_is_replaced_after_its_forks",
            a_zygote_is_replaced_after_its_forks,
        ),
        (
            "forked_workers_hold_nothing_of_the_zygote_s",
            forked_workers_hold_nothing_of_the_zygote_s,
        ),
        (
            "forked_workers_share_what_loading_wrote",
            forked_workers_share_what_loading_wrote,
        ),
        (
            "workers_come_from_the_program_when_no_zygote_can_be_had",
            workers_come_from_the_program_when_no_zygote_can_be_had,
        ),
        (
            "a_zygote_that_died_is_replaced",
            a_zygote_that_died_is_replaced,
        ),
        (
            "children_give_back_pages_they_hold_unchanged",
            children_give_back_pages_they_hold_unchanged,
        ),
        (
            "idle_workers_prime_themselves_for_the_snapshot_spawned_from",
            idle_workers_prime_themselves_for_the_snapshot_spawned_from,
        ),
        (
            "children_guest_ram_is_open_to_page_merging",
            children_guest_ram_is_open_to_page_merging,
        ),
        (
            "children_prefault_their_snapshot_s_working_set",
            children_prefault_their_snapshot_s_working_set,
        ),
        (
            "children_restore_from_a_held_image",
            children_restore_from_a_held_image,
        ),
        (
            "prestarted_workers_are_waiting_for_their_job",
            prestarted_workers_are_waiting_for_their_job,
        ),
        (
            "workers_without_a_user_of_their_own_go_back_to_the_host_s_mounts",
            workers_without_a_user_of_their_own_go_back_to_the_host_s_mounts,
        ),
        (
            "a_parent_that_cannot_boot_fails_with_its_vmm_s_reason",
            a_parent_that_cannot_boot_fails_with_its_vmm_s_reason,
        ),
        ("spawn_list_kill_readopt", spawn_list_kill_readopt),
        (
            "limits_without_cgroups_are_refused",
            limits_without_cgroups_are_refused,
        ),
        (
            "children_are_held_to_their_cgroup_limits",
            children_are_held_to_their_cgroup_limits,
        ),
        (
            "a_full_disk_fails_the_branch_and_keeps_the_source",
            a_full_disk_fails_the_branch_and_keeps_the_source,
        ),
        (
            "a_source_killed_mid_branch_leaves_a_whole_snapshot_or_none",
            a_source_killed_mid_branch_leaves_a_whole_snapshot_or_none,
        ),
        (
            "a_branch_is_a_diff_layer_other_hosts_fork",
            a_branch_is_a_diff_layer_other_hosts_fork,
        ),
        ("branching_running_children", branching_running_children),
        (
            "a_guest_that_stops_ends_its_vmm",
            a_guest_that_stops_ends_its_vmm,
        ),
        (
            "stale_record_is_neither_adopted_nor_killed",
            stale_record_is_neither_adopted_nor_killed,
        ),
        (
            "a_full_host_refuses_with_exhausted",
            a_full_host_refuses_with_exhausted,
        ),
        (
            "a_burst_leaves_at_most_the_pool_idle",
            a_burst_leaves_at_most_the_pool_idle,
        ),
        (
            "killing_a_queued_child_cancels_it",
            killing_a_queued_child_cancels_it,
        ),
        (
            "adoption_takes_only_ready_vmm_workers",
            adoption_takes_only_ready_vmm_workers,
        ),
        (
            "a_host_without_the_snapshot_fetches_it_from_the_store",
            a_host_without_the_snapshot_fetches_it_from_the_store,
        ),
        (
            "a_cold_host_restores_lazily_and_prefetches_the_working_set",
            a_cold_host_restores_lazily_and_prefetches_the_working_set,
        ),
        (
            "a_bounded_cache_evicts_what_no_child_runs_from",
            a_bounded_cache_evicts_what_no_child_runs_from,
        ),
        (
            "deleting_a_snapshot_collects_its_layers",
            deleting_a_snapshot_collects_its_layers,
        ),
        (
            "spawn_phases_are_spans_of_the_callers_trace",
            spawn_phases_are_spans_of_the_callers_trace,
        ),
        ("vmm_workers_are_confined", vmm_workers_are_confined),
    ];
    let mut failed = 0;
    for (name, test) in tests {
        if filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let t = Instant::now();
        match std::panic::catch_unwind(test) {
            Ok(()) => println!("test {name} ... ok ({:.1} s)", t.elapsed().as_secs_f64()),
            Err(_) => {
                println!("test {name} ... FAILED");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        println!("{failed} failed");
        std::process::exit(1);
    }
}
