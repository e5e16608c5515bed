//! The load generator end to end, in both control-plane placements: a real control plane
//! (SQLite file, audit log, token auth) behind real gRPC, null executors behind it.

use std::process::Command;

fn first_allowed_cpu() -> String {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim();
    list.split([',', '-']).next().unwrap().to_string()
}

fn run(extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let out = Command::new(env!("CARGO_BIN_EXE_tine-loadtest"))
        .args([
            "--clients",
            "4",
            "--rate-per-client",
            "20",
            "--duration-secs",
            "2",
        ])
        .arg("--json")
        .arg(&json)
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tine-loadtest {extra:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("spawn phases inside the control plane"),
        "{stdout}"
    );
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

fn check(v: &serde_json::Value, placement: &str) {
    assert_eq!(v["params"]["control_plane"], placement);
    assert_eq!(v["errors"], serde_json::json!({}), "{v}");
    let spawns = v["ops"]["spawn"]["count"].as_u64().unwrap();
    assert!(spawns > 0, "{v}");
    for op in ["exec", "kill"] {
        assert_eq!(v["ops"][op]["count"].as_u64(), Some(spawns), "{v}");
    }
    // The control plane's own phases come back from whichever process ran it, one sample
    // per spawn the clients timed.
    assert_eq!(
        v["spawn_phases"]["total"]["count"].as_u64(),
        Some(spawns),
        "{v}"
    );
    assert!(v["inline_busy_fallbacks"].is_u64(), "{v}");
}

#[test]
fn in_process_control_plane() {
    check(&run(&[]), "in-process");
}

#[test]
fn control_plane_in_its_own_pinned_process() {
    let cpu = first_allowed_cpu();
    let v = run(&["--cp-cpus", &cpu, "--load-cpus", &cpu]);
    check(&v, "own process");
    assert_eq!(v["params"]["cp_cpus"], cpu.as_str());
}

#[test]
fn a_control_plane_apart_keeps_the_cpus_the_load_gave_up() {
    let allowed: tine_loadtest::split::CpuList = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let v = run(&["--split", "--load-cpus", &first_allowed_cpu()]);
    check(&v, "own process");
    assert_eq!(v["params"]["cp_cpus"], allowed.to_string().as_str());
}

/// Standing children and a recorded history, in both placements: the control plane's figures
/// count the load's spawns only (`check`), not the calls that stood the children up.
#[test]
fn standing_children_and_history_are_set_up_before_the_clock() {
    for extra in [&[][..], &["--split"]] {
        let args = [
            extra,
            &[
                "--standing",
                "250",
                "--history",
                "5000",
                "--history-days",
                "6",
            ],
        ]
        .concat();
        let v = run(&args);
        check(
            &v,
            if extra.is_empty() {
                "in-process"
            } else {
                "own process"
            },
        );
        assert_eq!(v["params"]["standing"], 250);
        assert_eq!(v["params"]["history"], 5000);
        assert_eq!(v["params"]["history_days"], 6);
        // All within the retention (a week): the run forgets none of them.
        assert_eq!(v["forgotten"], 0);
    }
}

#[test]
fn bad_cpu_lists_and_conflicts_are_refused() {
    for (args, why) in [
        (&["--cp-cpus", "x"][..], "bad CPU"),
        (&["--load-cpus", "3-1"], "bad CPU range"),
        (
            &["--split", "--addr", "http://127.0.0.1:1"],
            "cannot be used with",
        ),
        // Options only an external control plane uses are not silently dropped.
        (&["--tag", "warm"], "required arguments were not provided"),
        (&["--token-file", "/dev/null"], "--addr"),
        // History is written into the embedded control plane's own database only.
        (
            &["--history", "10", "--addr", "http://127.0.0.1:1"],
            "cannot be used with",
        ),
        (&["--history-days", "0"], "not in 1..=3650"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_tine-loadtest"))
            .args(args)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(stderr.contains(why), "{args:?}: {stderr}");
    }
}
