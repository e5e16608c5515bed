//! The `tine exec|eval|cp|ping` commands, run in-process against the agent.

mod common;

use clap::Parser;
use common::TestAgent;
use tine_agent::cli::{run_with, AgentCli, EXIT_TIMED_OUT};

fn tine(agent: &TestAgent, args: &[&str]) -> (i32, String, String) {
    let mut argv = vec!["tine", "--agent-unix", agent.socket.to_str().unwrap()];
    argv.extend_from_slice(args);
    let cli = AgentCli::try_parse_from(argv).unwrap();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = run_with(&cli.target, &cli.command, &mut out, &mut err).unwrap();
    (
        code,
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    )
}

#[test]
fn exec_passes_output_env_and_exit_code() {
    let agent = TestAgent::start();
    let (code, out, err) = tine(
        &agent,
        &[
            "exec",
            "--env",
            "A=1",
            "--",
            "sh",
            "-c",
            "echo $A; echo oops >&2; exit 4",
        ],
    );
    assert_eq!((code, out.as_str(), err.as_str()), (4, "1\n", "oops\n"));
}

#[test]
fn exec_timeout_exits_124_with_message() {
    let agent = TestAgent::start();
    let (code, _, err) = tine(&agent, &["exec", "--timeout", "0.2", "--", "sleep", "60"]);
    assert_eq!(code, EXIT_TIMED_OUT);
    assert!(err.contains("timed out"), "{err}");
}

#[test]
fn eval_prints_repr_or_traceback() {
    let agent = TestAgent::start();
    assert_eq!(
        tine(&agent, &["eval", "1+1"]),
        (0, "2\n".into(), String::new())
    );
    let (code, _, err) = tine(&agent, &["eval", "undefined_name"]);
    assert_eq!(code, 1);
    assert!(err.contains("NameError"), "{err}");
}

#[test]
fn cp_both_directions_and_ping() {
    let agent = TestAgent::start();
    let host = tempfile::tempdir().unwrap();
    let src = host.path().join("in.txt");
    std::fs::write(&src, "payload").unwrap();
    let guest_dir = format!("vm:{}/", agent.path(""));
    assert_eq!(
        tine(&agent, &["cp", src.to_str().unwrap(), &guest_dir]).0,
        0
    );
    assert_eq!(
        std::fs::read(agent.dir.path().join("in.txt")).unwrap(),
        b"payload"
    );

    let back = host.path().join("back");
    std::fs::create_dir(&back).unwrap();
    let guest_file = format!("vm:{}", agent.path("in.txt"));
    assert_eq!(
        tine(&agent, &["cp", &guest_file, back.to_str().unwrap()]).0,
        0
    );
    assert_eq!(std::fs::read(back.join("in.txt")).unwrap(), b"payload");

    let (code, out, _) = tine(&agent, &["ping"]);
    assert_eq!(code, 0);
    assert!(out.contains(": ready"), "{out}");
}
