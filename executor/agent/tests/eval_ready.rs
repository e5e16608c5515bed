//! Warm Python eval and warm-up readiness against the real agent binary.

mod common;

use std::time::Duration;

use common::TestAgent;
use tine_agent::client::{ClientError, Readiness};

#[test]
fn eval_values_state_and_exceptions() {
    let agent = TestAgent::start();
    let c = agent.client();
    let r = c.eval("1+1").unwrap();
    assert_eq!(r.value.as_deref(), Some("2"));
    assert_eq!(r.error, None);
    assert_eq!(r.restarted, None);

    // Globals persist across evals; statements print, the last expression is the value.
    assert_eq!(c.eval("counter = 41").unwrap().value, None);
    let r = c
        .eval("counter += 1\nprint('side', 'effect')\ncounter")
        .unwrap();
    assert_eq!(r.value.as_deref(), Some("42"));
    assert_eq!(r.stdout, "side effect\n");
    assert_eq!(c.eval("'a' * 3").unwrap().value.as_deref(), Some("'aaa'"));

    // An exception carries the user's traceback and leaves the interpreter usable.
    let r = c.eval("def f():\n    return 1/0\nf()").unwrap();
    let tb = r.error.expect("raised");
    assert!(tb.contains("ZeroDivisionError"), "{tb}");
    assert!(tb.contains("line 2, in f"), "{tb}");
    assert!(!tb.contains("_tine_eval"), "driver frames leak: {tb}");
    assert_eq!(c.eval("counter").unwrap().value.as_deref(), Some("42"));

    let r = c.eval("def broken(:").unwrap();
    assert!(r.error.unwrap().contains("SyntaxError"));
    // Even SystemExit does not end the interpreter.
    assert!(c.eval("raise SystemExit(3)").unwrap().error.is_some());
    assert_eq!(c.eval("counter").unwrap().value.as_deref(), Some("42"));
}

#[test]
fn interpreter_death_is_reported_and_recovered() {
    let agent = TestAgent::start();
    let c = agent.client();
    c.eval("x = 1").unwrap();
    let r = c.eval("import os; os._exit(7)").unwrap();
    assert!(r.error.unwrap().contains("died"));
    assert!(r.restarted.unwrap().contains("globals lost"));
    let r = c.eval("'x' in globals()").unwrap();
    assert_eq!(r.value.as_deref(), Some("False"));
}

#[test]
fn eval_timeout_kills_and_restarts() {
    let agent = TestAgent::start();
    let c = agent.client();
    let r = c
        .eval_with_timeout(
            "import time; time.sleep(60)",
            Some(Duration::from_millis(200)),
        )
        .unwrap();
    assert!(r.error.unwrap().contains("timed out"));
    assert!(r.restarted.is_some());
    assert_eq!(c.eval("2*3").unwrap().value.as_deref(), Some("6"));
}

#[test]
fn reseed_reseeds_loaded_random_module() {
    let agent = TestAgent::start();
    let c = agent.client();
    c.eval("import random").unwrap();
    // No entropy bytes: the test host's kernel pool is left alone.
    let r = c.reseed(&[], None).unwrap();
    assert_eq!(r.python_reseeded, ["random"]);
}

#[test]
fn wake_is_refused_without_a_time_or_entropy_before_it_changes_anything() {
    let agent = TestAgent::start();
    let c = agent.client();
    // Both are refused before any side effect, so the test host's clock and pool are untouched.
    let t = Duration::from_secs(5);
    let e = c
        .wake(std::time::UNIX_EPOCH, &[7; 16], None, t)
        .unwrap_err();
    assert!(e.to_string().contains("unix_nanos must be set"), "{e}");
    let e = c
        .wake(std::time::SystemTime::now(), &[], None, t)
        .unwrap_err();
    assert!(e.to_string().contains("entropy must not be empty"), "{e}");
    assert!(!e.is_unknown_request());
}

#[test]
fn warmup_reports_warming_then_ready() {
    // The warm-up blocks until the test creates the release file, so the
    // `warming` state is observed deterministically (no sleeps or timings).
    let dir = tempfile::tempdir().unwrap();
    let release = dir.path().join("release");
    let warmup = format!(
        "import os, time\nwhile not os.path.exists({:?}): time.sleep(0.01)\nwarmed = 'yes'",
        release.to_str().unwrap()
    );
    let warmup_file = dir.path().join("warmup.py");
    std::fs::write(&warmup_file, &warmup).unwrap();
    let agent = TestAgent::with_config(&format!(
        "python = python3\nwarmup_file = {}\n",
        warmup_file.display()
    ));
    let c = agent.client();
    let p = c.ping().unwrap();
    assert_eq!(p.readiness, Readiness::Warming);
    assert_eq!(p.ready_for, None);
    assert!(p.warmup_command.contains("warmed = 'yes'"));
    let seen_warming = p.uptime;
    let err = c.wait_ready(Duration::from_millis(100)).unwrap_err();
    assert!(
        matches!(&err, ClientError::NotReady { detail, .. } if detail.contains("warmed = 'yes'")),
        "{err}"
    );

    std::fs::write(&release, "").unwrap();
    let p = c.wait_ready(Duration::from_secs(60)).unwrap();
    assert_eq!(p.readiness, Readiness::Ready);
    // It says when it became ready (by its own clock): after it was seen warming.
    let ready_for = p.ready_for.expect("a ready agent says since when");
    assert!(
        p.uptime - ready_for > seen_warming,
        "{p:?} seen warming at {seen_warming:?}"
    );
    // The warm-up ran in the same interpreter that serves evals.
    assert_eq!(c.eval("warmed").unwrap().value.as_deref(), Some("'yes'"));
}

#[test]
fn failing_warmup_reports_failed_with_message() {
    let agent = TestAgent::with_config("warmup = import no_such_module_for_tine\n");
    let err = agent
        .client()
        .wait_ready(Duration::from_secs(60))
        .unwrap_err();
    match &err {
        ClientError::WarmupFailed { command, message } => {
            assert_eq!(command, "import no_such_module_for_tine");
            assert!(message.contains("ModuleNotFoundError"), "{message}");
        }
        other => panic!("expected WarmupFailed, got {other}"),
    }
    assert!(matches!(
        agent.client().ping().unwrap().readiness,
        Readiness::Failed(_)
    ));
}

#[test]
fn missing_python_fails_warmup_clearly() {
    let agent = TestAgent::with_config("python = /no/python/here\nwarmup = 1\n");
    let err = agent
        .client()
        .wait_ready(Duration::from_secs(60))
        .unwrap_err();
    assert!(err.to_string().contains("/no/python/here"), "{err}");
}
