//! Linux boot tests: they need real KVM with VMX/SVM, so on other hosts they run inside the
//! nested lab (`tine lab`). Slow (tens of seconds each), hence `#[ignore]`; CI runs them with
//! `cargo test -p tine-cli --test lab -- --ignored`.
//!
//! Inside the lab the host's cache (`$TINE_CACHE_DIR` or `~/.cache/tine`) is read-only, so
//! everything a scenario boots (kernel, smoke initramfs, images) is prepared here on the host
//! first; the tests work from an empty cache.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

const TINE: &str = env!("CARGO_BIN_EXE_tine");

/// A single guest boot takes well under a minute in the lab; one that has not finished in
/// this long is hung (L1 stalled), and is better retried than sat out.
const SHORT_BOOT_SECS: u32 = 240;

/// The several-hosts scenario is the lab's longest: a parent boot, four executors, moto_server
/// and 21 children, most of them on hosts that fetch from the store. It took 605 s (debug
/// build, one L1 CPU, 2026-12-01): twice that before it is taken for a stall, so a slow CI
/// machine does not turn it into a timeout and a retry.
const MULTIHOST_SECS: u32 = 1200;

/// The embedded deployment's scenario (up.sh: networking, limits, hostile guests, branches,
/// the Python client) took about 780 s in a passing CI run on a slow machine (debug build, one
/// L1 CPU, 2026-12-01), then ran past the 900 s every one-CPU scenario had twice on the same
/// machine an hour later, with no check failed: it gets room of its own, as the several-hosts
/// scenario does.
const UP_SECS: u32 = 1200;

/// `tine <args>` where Linux boots, for a single short guest boot, with the lab's limit cut to
/// [`SHORT_BOOT_SECS`].
fn tine_boots_briefly(args: &[&str]) -> (i32, String) {
    let mut argv = vec![TINE];
    argv.extend_from_slice(args);
    where_linux_boots_within(2, Some(SHORT_BOOT_SECS), &argv)
}

/// Run `argv` where Linux can boot: directly on VMX/SVM hosts, else inside the lab with
/// `lab_cpus` emulated CPUs for L1.
fn where_linux_boots_on(lab_cpus: u32, argv: &[&str]) -> (i32, String) {
    where_linux_boots_within(lab_cpus, None, argv)
}

/// [`where_linux_boots_on`] with the lab's wall-clock limit set to `limit_secs` when given.
fn where_linux_boots_within(
    lab_cpus: u32,
    limit_secs: Option<u32>,
    argv: &[&str],
) -> (i32, String) {
    let run = lab_run(lab_cpus, limit_secs, argv, true);
    (run.code, run.out)
}

/// One command where Linux boots: its exit code and output, and whether it is a second run.
struct LabRun {
    code: i32,
    out: String,
    retried: bool,
}

/// [`where_linux_boots_within`]; with `retry_lab`, a run the lab itself failed (L1 died or
/// stalled past the limit) is run once more.
fn lab_run(lab_cpus: u32, limit_secs: Option<u32>, argv: &[&str], retry_lab: bool) -> LabRun {
    let direct = !std::path::Path::new("/sys/module/kvm_pvm").exists()
        && std::fs::read_to_string("/proc/cpuinfo")
            .map(|c| c.split_whitespace().any(|w| w == "vmx" || w == "svm"))
            .unwrap_or(false);
    let mut cmd = if direct {
        let mut c = Command::new(argv[0]);
        c.args(&argv[1..]);
        c
    } else {
        let mut c = Command::new(TINE);
        // Room for a hundred forked children next to their snapshot in L1's tmpfs.
        // A scenario that needs longer than this is hung: better to fail (or retry) than to
        // sit out the lab's default 15 minutes.
        let cpus = lab_cpus.to_string();
        let timeout = limit_secs
            .unwrap_or(if lab_cpus == 1 { 900 } else { 600 })
            .to_string();
        c.args([
            "lab",
            "--cpus",
            &cpus,
            "--mem-mib",
            "8192",
            "--timeout",
            &timeout,
            "--",
        ])
        .args(argv);
        c
    };
    // What the timing line names: the command and its first arguments, without directories.
    let what = argv
        .iter()
        .map(|a| {
            Path::new(a)
                .file_name()
                .map_or(*a, |n| n.to_str().unwrap_or(a))
        })
        .take(4)
        .collect::<Vec<_>>()
        .join(" ");
    let run = |cmd: &mut Command| {
        let started = Instant::now();
        let out = cmd.output().expect("running tine");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let code = out.status.code().unwrap_or(-1);
        log_time(
            &format!("lab ({lab_cpus} CPU): {what}: exit {code}"),
            started,
        );
        (code, text)
    };
    let (mut code, mut out) = run(&mut cmd);
    // The lab's L1 is a software-emulated CPU running nested KVM; under load its kernel has been
    // seen to die on its own (with two CPUs, an int3 Oops in L1's own scheduler before the
    // command ran, twice in a row in one CI run), and (rarely, with two CPUs) to stall so that
    // not even the guest's first console line comes out. That is the lab failing, not the code
    // under test: a run whose L1 died is retried up to twice, a stalled one (which costs the
    // whole limit) once, each saying so in the log. A test assertion failure is never retried.
    let mut retried = false;
    let mut deaths = 0;
    loop {
        let died = lab_died(&out);
        let again = died && deaths < 2 || lab_timed_out(&out) && !retried;
        if !retry_lab || direct || !again {
            break;
        }
        deaths += usize::from(died);
        eprintln!(
            "NOTE: the nested lab's L1 died or stalled past its limit (not the guest under test; see docs/lab.md); retrying:\n{out}"
        );
        (code, out) = run(&mut cmd);
        retried = true;
    }
    LabRun { code, out, retried }
}

/// One line per lab run or host build with its wall time, on the test process's own stderr:
/// it bypasses the harness's capture, so CI's log shows where the lab phase's time goes even
/// when every test passes.
fn log_time(what: &str, started: Instant) {
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "[lab timing] {:>6.0} s  {what}",
        started.elapsed().as_secs_f64()
    );
}

fn lab_died(out: &str) -> bool {
    out.contains("L1 stopped") && out.contains("without reporting the command's exit status")
}

/// The run went past the lab's wall-clock limit and QEMU was killed.
fn lab_timed_out(out: &str) -> bool {
    out.contains("did not finish within")
}

/// Runs `tine <args>` on the host, which must succeed; returns its stdout.
fn tine_on_host(args: &[&str]) -> String {
    let started = Instant::now();
    let out = Command::new(TINE)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("tine {args:?}: {e}"));
    log_time(&format!("host: tine {}", args.join(" ")), started);
    assert!(
        out.status.success(),
        "tine {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The cached cloud kernel's `vmlinux-*` or `vmlinuz-*` path, fetched on the host if needed,
/// and the smoke initramfs that `tine run` boots when no `--initrd` is given.
fn cached_kernel(file_prefix: &str) -> String {
    // `tine image kernel` prints the cached kernel's paths.
    let text = tine_on_host(&["image", "kernel", "--flavor", "cloud", "--vmlinux"]);
    tine_on_host(&["image", "initramfs"]);
    text.split_whitespace()
        .find(|w| {
            std::path::Path::new(w)
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with(file_prefix))
        })
        .unwrap_or_else(|| panic!("no {file_prefix}* path in: {text}"))
        .to_string()
}

/// The host crate's test binary (`executor/host/tests/host.rs`): `$TINE_HOST_TEST_BIN`, which
/// deploy/dev/test.sh sets from cargo's own report, else the newest one cargo built.
fn host_test_binary() -> String {
    if let Ok(p) = std::env::var("TINE_HOST_TEST_BIN") {
        return p;
    }
    let deps = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/deps");
    std::fs::read_dir(&deps)
        .unwrap_or_else(|e| panic!("{}: {e}", deps.display()))
        .flatten()
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("host-") && !name.contains('.')
        })
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .map(|e| e.path().display().to_string())
        .expect("no host test binary: run `cargo test -p tine-host --no-run` first")
}

#[test]
#[ignore = "needs cgroup v2 with its controllers next to real KVM: the nested lab's L1 has both"]
fn children_are_confined_by_their_cgroups() {
    // Tiny hand-made guests (no Linux to boot): a page-writing hog under 64 MiB, a busy guest
    // at 100 millis, an idle sibling; see the test itself in the host crate.
    let bin = host_test_binary();
    let (code, out) = where_linux_boots_on(1, &[&bin, "children_are_held_to_their_cgroup_limits"]);
    assert!(!out.contains("SKIPPED"), "cgroups were not usable:\n{out}");
    assert!(
        out.contains("test children_are_held_to_their_cgroup_limits ... ok"),
        "{out}"
    );
    assert_eq!(code, 0, "{out}");
    for l in out
        .lines()
        .filter(|l| l.contains("of a core") || l.contains("out of memory"))
    {
        println!("{l}");
    }
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab (slow)"]
fn pvh_boot_with_two_vcpus_reaches_init_and_powers_off() {
    let kernel = cached_kernel("vmlinux-");
    let (code, out) = tine_boots_briefly(&["run", "--vcpus", "2", "--kernel", &kernel]);
    assert!(
        out.contains("TINE-BOOT-OK cpus=2 "),
        "no marker with 2 CPUs in:\n{out}"
    );
    assert_eq!(code, 0, "VMM exit status after guest poweroff:\n{out}");
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab (slow)"]
fn bzimage_boot_reaches_init_and_powers_off() {
    let kernel = cached_kernel("vmlinuz-");
    let (code, out) = tine_boots_briefly(&["run", "--kernel", &kernel]);
    assert!(out.contains("TINE-BOOT-OK cpus=1 "), "no marker in:\n{out}");
    assert_eq!(code, 0, "{out}");
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab (slow)"]
fn guest_reboot_is_reported_in_the_exit_status() {
    let kernel = cached_kernel("vmlinux-");
    // rdinit=/bin/reboot: the first userspace program asks the kernel to restart at once.
    let (code, out) = tine_boots_briefly(&[
        "run",
        "--kernel",
        &kernel,
        "--append",
        "rdinit=/bin/reboot -f",
    ]);
    assert_eq!(code, 2, "reboot must exit 2:\n{out}");
}

/// The static guest agent (see `tine_agent::build::static_agent_for_tests`).
fn static_agent() -> &'static Path {
    tine_agent::build::static_agent_for_tests()
}

/// Build (or reuse) a guest image on the host, where the package mirror is reachable and the
/// cache writable.
fn build_image(recipe: &str) {
    let agent = static_agent().to_str().expect("agent path is UTF-8");
    tine_on_host(&["image", "build", recipe, "--agent", agent]);
}

/// The busybox image with the agent that breaches the protocol on request (hostile.sh).
fn build_hostile_image() {
    let agent = tine_agent::build::static_hostile_agent_for_tests();
    let agent = agent.to_str().expect("agent path is UTF-8");
    tine_on_host(&[
        "image",
        "build",
        "busybox",
        "--agent",
        agent,
        "--name",
        "busybox-hostile",
    ]);
}

/// Run a scenario script and check every `CHECK` line it prints.
fn scenario(script: &str, image: &str, expected: &[&str]) -> String {
    scenario_args(script, image, &[], expected)
}

fn scenario_args(script: &str, image: &str, extra: &[&str], expected: &[&str]) -> String {
    scenario_args_on(2, script, image, extra, expected)
}

fn scenario_args_on(
    lab_cpus: u32,
    script: &str,
    image: &str,
    extra: &[&str],
    expected: &[&str],
) -> String {
    scenario_args_within(lab_cpus, None, script, image, extra, expected)
}

/// [`scenario_args_on`] with the lab's wall-clock limit set to `limit_secs` when given.
fn scenario_args_within(
    lab_cpus: u32,
    limit_secs: Option<u32>,
    script: &str,
    image: &str,
    extra: &[&str],
    expected: &[&str],
) -> String {
    let path = format!("{}/tests/lab/{script}", env!("CARGO_MANIFEST_DIR"));
    let work = format!(
        "/tmp/tine-{}-{}",
        script.trim_end_matches(".sh"),
        std::process::id()
    );
    let mut argv = vec!["sh", path.as_str(), TINE, image, work.as_str()];
    argv.extend_from_slice(extra);
    let first = lab_run(lab_cpus, limit_secs, &argv, true);
    let (mut code, mut out) = (first.code, first.out);
    // A run that failed because a guest died under the lab's emulated CPU (while booting, or a
    // triple fault the VMM logged; seen rarely, and never on the same run twice) is retried
    // once, loudly; any other failure and a second death are reported as they are. A run that
    // passed is never rerun, whatever it logged. One the lab already ran again (L1 died or
    // stalled) is not retried here, and this retry is not retried by the lab: a scenario runs
    // twice at most, or three times when L1 itself died twice.
    let failed = code != 0
        || out
            .lines()
            .any(|l| l.starts_with("CHECK ") && l.contains(" FAIL"));
    let guest_died = out.contains("CHECK ready FAIL VM exited")
        || out.contains("CHECK ready FAIL not ready after")
        || out.contains("guest triple fault");
    if failed && guest_died && !first.retried {
        eprintln!("NOTE: the guest VM died (an open lab issue, see docs/fork.md); retrying the scenario once:\n{out}");
        let second = lab_run(lab_cpus, limit_secs, &argv, false);
        (code, out) = (second.code, second.out);
    }
    let checks: Vec<&str> = out.lines().filter(|l| l.starts_with("CHECK ")).collect();
    for name in expected {
        let line = checks
            .iter()
            .find(|l| l.split_whitespace().nth(1) == Some(name))
            .unwrap_or_else(|| panic!("no CHECK {name} (exit {code}) in:\n{out}"));
        assert!(
            line.ends_with(" ok") || line.contains(" ok:"),
            "{line}\n{out}"
        );
    }
    assert!(!checks.iter().any(|l| l.contains(" FAIL ")), "{out}");
    out
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab (slow)"]
fn agent_exec_streams_files_and_timeouts_in_a_busybox_guest() {
    build_image("busybox");
    scenario(
        "agent.sh",
        "busybox",
        &[
            "ready",
            "uname",
            "exit-code",
            "streams-10mb",
            "file-50mb",
            "timeout",
            "hostile-path",
            "poweroff",
        ],
    );
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab (slow)"]
fn a_service_killed_while_a_parent_writes_its_snapshot_leaves_a_failed_record_and_a_retry_works() {
    build_image("busybox");
    // One L1 CPU: two services, a booting parent and a shell polling the snapshot directory
    // are steadier on one (docs/lab.md).
    scenario_args_on(
        1,
        "killsnap.sh",
        "busybox",
        &[],
        &[
            "executor-registered",
            "writing-1",
            "create-1-fails",
            "no-copy-1",
            "record-failed-1",
            "executor-back",
            "nothing-left-1",
            "retry-1",
            "ready-1",
            "child-1",
            "writing-2",
            "create-2-fails",
            "executor-up-2",
            "record-failed-2",
            "no-spawn-of-failed",
            "retry-2",
            "ready-2",
            "child-2",
        ],
    );
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab (slow)"]
fn forked_children_get_a_new_vm_generation_id() {
    // Debian's generic kernel: the cloud kernel has no CONFIG_VMGENID driver.
    let agent = static_agent().to_str().expect("agent path is UTF-8");
    tine_on_host(&[
        "image",
        "build",
        "busybox",
        "--agent",
        agent,
        "--kernel",
        "generic",
        "--name",
        "busybox-generic",
    ]);
    let out = scenario_args_on(
        1,
        "vmgenid.sh",
        "busybox-generic",
        &[],
        &[
            "snapshot",
            "driver-binding-recorded",
            "fork-3",
            "vmgenid-driver-bound",
            "ged-interrupt-raised",
            "kernel-reseeded-on-fork",
        ],
    );
    for l in out.lines().filter(|l| !l.starts_with("CHECK")) {
        println!("{l}");
    }
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab; builds a Debian root filesystem (slow)"]
fn warm_numpy_eval_in_the_python_image() {
    build_image("python-numpy");
    // One emulated CPU for L1, as for the fork scenario: with two, a cold-booted guest here
    // triple-faulted once during the agent bench (CI, stop 22), the same unexplained SMP-path
    // fault docs/fork.md describes for restored guests.
    let out = scenario_args_on(
        1,
        "eval.sh",
        "python-numpy",
        &[],
        &[
            "ready",
            "numpy-zeros",
            "exception",
            "usable-after-exception",
            "bench",
            "poweroff",
        ],
    );
    // The latency table is the benchmark's output: show it in the test log.
    for l in out
        .lines()
        .filter(|l| l.contains("ms") || l.contains("faster"))
    {
        println!("{l}");
    }
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab; builds a Debian root filesystem (slow)"]
fn snapshot_a_warm_parent_and_fork_children() {
    build_image("python-numpy");
    // One emulated CPU for L1: with two, a restored guest triple-faults now and then under
    // this load (1 in 52 restores in one CI run, 5 in 100 earlier; never in 210 restores with
    // one CPU), which points at the emulated SVM's SMP path rather than the restore itself.
    // The open question stays documented in docs/fork.md.
    let out = scenario_args_on(
        1,
        "fork.sh",
        "python-numpy",
        &["20"],
        &[
            "snapshot",
            "vmgenid-driver-not-bound",
            "fork-10",
            "parent-state-in-every-child",
            "no-ged-interrupt",
            "divergence",
            "sleep-1s",
            "wall-clock",
            "urandom-differs",
            "python-random-differs",
            "identity-distinct",
            "new-child-clean",
            "fork-20",
            "cpu-marks",
            "bench",
        ],
    );
    for l in out.lines().filter(|l| !l.starts_with("CHECK")) {
        println!("{l}");
    }
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab; builds a Debian root filesystem (slow)"]
fn control_plane_end_to_end_with_the_python_client() {
    build_image("python-numpy");
    build_hostile_image();
    let venv = std::env::var("TINE_PY_VENV").unwrap_or_else(|_| {
        format!(
            "{}/.cache/tine/pyclient-venv",
            std::env::var("HOME").unwrap_or_else(|_| "/root".into())
        )
    });
    assert!(
        Path::new(&venv).join("bin/python").exists(),
        "no Python client venv at {venv}: run clients/python/run_tests.sh (the api test does)"
    );
    // One L1 CPU: the sandboxes here are branched and rebased (many remappings of guest
    // memory), under which L1 with two emulated CPUs has hung outright (docs/fork.md).
    let out = scenario_args_within(
        1,
        Some(UP_SECS),
        "up.sh",
        "python-numpy",
        &[&venv],
        &[
            "up",
            "snapshot-api",
            "spawn-cli",
            "eval-cli",
            "net-internet",
            "net-two-children",
            "net-denied",
            "net-allow-list",
            "net-deny-list",
            "net-no-host",
            "net-no-siblings",
            "net-exposed-port",
            "net-cleanup",
            "limits-floor",
            "limits-cgroup",
            "limits-cpu-share",
            "limits-oom",
            "limits-oom-audited",
            "hostile-flood",
            "hostile-garbage",
            "hostile-oversized",
            "hostile-cap",
            "hostile-sibling",
            "hostile-stall",
            "hostile-never-reads",
            "hostile-memory",
            "hostile-cancel",
            "lifetime-expired",
            "python-example",
            "python-tests",
            "branch-cli",
            "branch-source-clock",
            "branch-no-wait",
            "python-branch-demo",
            "executor-metrics",
            "shutdown",
        ],
    );
    // What the user saw: spawn lines, the example's evals, the executors table.
    println!("{out}");
}

#[test]
#[ignore = "boots Linux: needs VMX/SVM or the nested lab; builds a Debian root filesystem (slow)"]
fn several_hosts_share_one_s3_store() {
    build_image("python-numpy");
    // moto_server and grpcurl, as deploy/dev/setup.sh installs them.
    let venv = std::env::var("TINE_VENV").unwrap_or_else(|_| {
        format!(
            "{}/.cache/tine/venv",
            std::env::var("HOME").unwrap_or_else(|_| "/root".into())
        )
    });
    assert!(
        Path::new(&venv).join("bin/moto_server").exists(),
        "no moto_server in {venv}: run deploy/dev/setup.sh"
    );
    // One L1 CPU: with two, restored guests have triple-faulted now and then under this much
    // nested load and L1's own kernel has died (docs/fork.md); one is slower but steady.
    let out = scenario_args_within(
        1,
        Some(MULTIHOST_SECS),
        "multihost.sh",
        "python-numpy",
        &[&venv],
        &[
            "store",
            "executors-registered",
            "snapshot-on-a",
            "layers-recorded",
            "grpcurl-get-snapshot",
            "spawn-12",
            "spread-abc",
            "parent-value-everywhere",
            "fetched-what-lacked",
            "a-down-spawns-on-bc",
            "corrupt-refused",
            "others-unaffected",
            "branch-on-c-forked-on-b",
        ],
    );
    println!("{out}");
}
