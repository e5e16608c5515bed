//! Exec, file transfer and ping against the real agent binary.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::TestAgent;
use sha2::{Digest, Sha256};
use tine_agent::client::{AgentErrorCode, ClientError, ExecOptions, FileKind, Readiness};

#[test]
fn ping_reports_version_and_ready() {
    let agent = TestAgent::start();
    let p = agent.client().ping().unwrap();
    assert_eq!(p.agent_version, env!("CARGO_PKG_VERSION"));
    assert_eq!(p.readiness, Readiness::Ready);
    assert_eq!(p.warmup_command, "");
    // With no warm-up it has been ready since it started.
    assert_eq!(p.ready_for, Some(p.uptime));
}

#[test]
fn exec_uname_and_exit_codes() {
    let agent = TestAgent::start();
    let c = agent.client();
    let (st, out, _) = c
        .exec_output(&["uname", "-a"], &Default::default())
        .unwrap();
    assert!(st.success());
    assert!(
        String::from_utf8_lossy(&out).starts_with("Linux"),
        "{out:?}"
    );

    let (st, _, _) = c
        .exec_output(&["sh", "-c", "exit 3"], &Default::default())
        .unwrap();
    assert_eq!((st.code, st.signal, st.timed_out), (Some(3), None, false));

    let (st, _, _) = c
        .exec_output(&["sh", "-c", "kill -TERM $$"], &Default::default())
        .unwrap();
    assert_eq!((st.code, st.signal), (None, Some(libc::SIGTERM)));
}

#[test]
fn exec_env_cwd_stdin() {
    let agent = TestAgent::start();
    let opts = ExecOptions {
        env: vec![("GREETING".into(), "hello".into())],
        cwd: Some(agent.path("")),
        stdin: b"from stdin".to_vec(),
        timeout: None,
    };
    let (st, out, _) = agent
        .client()
        .exec_output(&["sh", "-c", "echo $GREETING; pwd; cat"], &opts)
        .unwrap();
    assert!(st.success());
    let expected = format!(
        "hello\n{}\nfrom stdin",
        agent.dir.path().canonicalize().unwrap().display()
    );
    assert_eq!(String::from_utf8(out).unwrap(), expected);
}

#[test]
fn exec_missing_program_is_an_agent_error() {
    let agent = TestAgent::start();
    let err = agent
        .client()
        .exec_output(&["/no/such/program"], &Default::default())
        .unwrap_err();
    assert!(
        matches!(&err, ClientError::Agent(m, AgentErrorCode::NotFound) if m.contains("/no/such/program")),
        "{err}"
    );
}

#[test]
fn large_interleaved_output_arrives_complete_and_in_order() {
    let agent = TestAgent::start();
    // 10 MB of numbered lines on stdout, a numbered line on stderr every 1000.
    let script = "import sys\n\
        for i in range(200000):\n\
        \x20   sys.stdout.write('%049d\\n' % i)\n\
        \x20   if i % 1000 == 0:\n\
        \x20       sys.stdout.flush(); sys.stderr.write('err %d\\n' % i); sys.stderr.flush()\n";
    let (st, out, err) = agent
        .client()
        .exec_output(&["python3", "-c", script], &Default::default())
        .unwrap();
    assert!(st.success(), "{st:?} {}", String::from_utf8_lossy(&err));
    assert_eq!(out.len(), 200_000 * 50);
    for (i, line) in out.split(|&b| b == b'\n').take(200_000).enumerate() {
        assert_eq!(line, format!("{i:049}").as_bytes(), "stdout line {i}");
    }
    let expected_err: String = (0..200_000)
        .step_by(1000)
        .map(|i| format!("err {i}\n"))
        .collect();
    assert_eq!(String::from_utf8(err).unwrap(), expected_err);
}

#[test]
fn timeout_kills_the_process_group() {
    let agent = TestAgent::start();
    let marker = agent.path("survivor");
    // The background child would create the marker if it outlived the kill.
    let script = format!("(sleep 3; touch {marker}) & echo started; sleep 60");
    let opts = ExecOptions {
        timeout: Some(Duration::from_millis(300)),
        ..Default::default()
    };
    let (st, out, _) = agent
        .client()
        .exec_output(&["sh", "-c", &script], &opts)
        .unwrap();
    assert!(st.timed_out, "{st:?}");
    assert_eq!(st.signal, Some(libc::SIGKILL));
    // Output produced before the kill is delivered (or nothing, if the
    // shell had not got that far); never anything after it.
    assert!(out.is_empty() || out == b"started\n", "{out:?}");
    // Exec only returned once the background subshell's end of the pipe
    // closed, so nothing holding the marker in its command line survives.
    let survivors: Vec<_> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .filter(|cmd| String::from_utf8_lossy(cmd).contains(&marker))
        .collect();
    assert!(survivors.is_empty(), "{survivors:?}");
}

#[test]
fn fifty_megabytes_round_trip_with_same_sha256() {
    let agent = TestAgent::start();
    let c = agent.client();
    let mut data = vec![0u8; 50 * 1024 * 1024];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let path = agent.path("big.bin");
    assert_eq!(
        c.write_file(&path, 0o600, data.as_slice()).unwrap(),
        data.len() as u64
    );
    let mut back = Vec::new();
    let info = c.read_file(&path, &mut back).unwrap();
    assert_eq!(info.size, data.len() as u64);
    assert_eq!(info.mode, 0o600);
    assert_eq!(Sha256::digest(&back), Sha256::digest(&data));
    // No temp file left behind.
    let names: Vec<_> = c
        .list_dir(&agent.path(""))
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert!(!names.iter().any(|n| n.contains(".tmp")), "{names:?}");
}

#[test]
fn write_replaces_atomically_and_list_dir_describes_entries() {
    let agent = TestAgent::start();
    let c = agent.client();
    let path = agent.path("f.txt");
    c.write_file(&path, 0, &b"first version"[..]).unwrap();
    c.write_file(&path, 0o755, &b"second"[..]).unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"second");
    c.write_file(&agent.path("empty"), 0, &b""[..]).unwrap();
    std::fs::create_dir(agent.path("sub")).unwrap();
    std::os::unix::fs::symlink("f.txt", agent.path("link")).unwrap();

    let entries = c.list_dir(&agent.path("")).unwrap();
    let find = |n: &str| entries.iter().find(|e| e.name == n).unwrap();
    assert_eq!(
        (find("f.txt").kind, find("f.txt").size, find("f.txt").mode),
        (FileKind::File, 6, 0o755)
    );
    assert_eq!(find("empty").size, 0);
    assert_eq!(find("empty").mode, 0o644);
    assert_eq!(find("sub").kind, FileKind::Dir);
    assert_eq!(find("link").kind, FileKind::Symlink);
}

#[test]
fn bad_paths_are_rejected_with_clear_errors() {
    let agent = TestAgent::start();
    let c = agent.client();
    let err = c.read_file("relative/path", std::io::sink()).unwrap_err();
    assert!(err.to_string().contains("relative"), "{err}");
    let dotdot = format!("{}/../escape", agent.path(""));
    let err = c.write_file(&dotdot, 0, &b"x"[..]).unwrap_err();
    assert!(
        matches!(&err, ClientError::Agent(m, AgentErrorCode::InvalidArgument) if m.contains("`..`")),
        "{err}"
    );
    let err = c.list_dir("/tmp/a\0b").unwrap_err();
    assert!(err.to_string().contains("NUL"), "{err}");
    let err = c
        .read_file("/definitely/not/here", std::io::sink())
        .unwrap_err();
    assert!(err.to_string().contains("/definitely/not/here"), "{err}");
}

#[test]
fn concurrent_calls_on_one_agent() {
    let agent = TestAgent::start();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let c = agent.client();
                s.spawn(move || {
                    let (st, out, _) = c
                        .exec_output(
                            &["sh", "-c", &format!("sleep 0.2; echo {i}")],
                            &Default::default(),
                        )
                        .unwrap();
                    assert!(st.success());
                    String::from_utf8(out).unwrap()
                })
            })
            .collect();
        // A ping is answered while the execs are still running.
        assert_eq!(agent.client().ping().unwrap().readiness, Readiness::Ready);
        for (i, h) in handles.into_iter().enumerate() {
            assert_eq!(h.join().unwrap(), format!("{i}\n"));
        }
    });
}

/// Raw frames, bypassing the client, to test the agent's input handling.
mod raw {
    use super::*;
    use prost::Message;
    use std::os::unix::net::UnixStream;
    use tine_agent::frame::{read_message, MAX_FRAME};
    use tine_agent::pb::{self, response::Kind};

    fn send_raw(agent: &TestAgent, bytes: &[u8]) -> pb::Response {
        let mut s = UnixStream::connect(&agent.socket).unwrap();
        s.write_all(bytes).unwrap();
        read_message(&mut s).unwrap()
    }

    fn error_of(resp: pb::Response) -> String {
        match resp.kind {
            Some(Kind::Error(e)) => e.message,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn unknown_message_type() {
        let agent = TestAgent::start();
        // Field 99 (length-delimited, empty): a request type this agent lacks.
        let msg = error_of(send_raw(&agent, &framed(&[0x9a, 0x06, 0x00])));
        assert!(msg.contains("unknown or missing request type"), "{msg}");
        // Still serving afterwards.
        agent.client().ping().unwrap();
    }

    #[test]
    fn malformed_protobuf() {
        let agent = TestAgent::start();
        let msg = error_of(send_raw(&agent, &framed(&[0x0a, 0x05, 0x01])));
        assert!(msg.contains("malformed request"), "{msg}");
    }

    #[test]
    fn oversized_frame_is_refused_and_connection_closed() {
        let agent = TestAgent::start();
        let mut s = UnixStream::connect(&agent.socket).unwrap();
        s.write_all(&((MAX_FRAME as u32) + 1).to_be_bytes())
            .unwrap();
        let resp: pb::Response = read_message(&mut s).unwrap();
        let msg = error_of(resp);
        assert!(msg.contains("exceeds"), "{msg}");
        let mut rest = Vec::new();
        assert_eq!(s.read_to_end(&mut rest).unwrap(), 0, "connection closed");
        agent.client().ping().unwrap();
    }

    #[test]
    fn chunk_without_write_file() {
        let agent = TestAgent::start();
        let req = pb::Request {
            kind: Some(pb::request::Kind::FileChunk(pb::FileChunk {
                data: vec![1],
                last: true,
            })),
        };
        let msg = error_of(send_raw(&agent, &framed(&req.encode_to_vec())));
        assert!(msg.contains("only valid after write_file"), "{msg}");
    }
}

/// A call that comes while another is being served (on the standing thread or not) gets a
/// thread of its own and is not held up, and calls are served again afterwards.
#[test]
fn calls_are_served_while_the_standing_thread_is_busy() {
    let agent = TestAgent::start();
    let slow = {
        let c = agent.client();
        std::thread::spawn(move || c.exec_output(&["sleep", "2"], &Default::default()))
    };
    // Ping until the slow call is surely being served, then check it still is.
    for _ in 0..5 {
        assert_eq!(agent.client().ping().unwrap().readiness, Readiness::Ready);
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        !slow.is_finished(),
        "pings were answered while the exec ran"
    );
    let (st, _, _) = slow.join().unwrap().unwrap();
    assert!(st.success());
    for _ in 0..3 {
        assert_eq!(agent.client().ping().unwrap().readiness, Readiness::Ready);
    }
}

/// A call that comes while the standing thread is idle runs on it: the command's parent
/// thread (the one whose `children` list holds it) is named `standing`.
#[test]
fn an_idle_agent_serves_a_call_on_its_standing_thread() {
    let agent = TestAgent::start();
    // `true` at the end: the loop's status is its last grep's, which fails for the other threads.
    let script =
        "for t in /proc/$PPID/task/*; do grep -qw $$ $t/children && cat $t/comm; done; true";
    let mut comm = String::new();
    // It is idle again once the previous call's connection has closed; allow for a slow start.
    for _ in 0..50 {
        let (st, out, _) = agent
            .client()
            .exec_output(&["sh", "-c", script], &Default::default())
            .unwrap();
        assert!(st.success());
        comm = String::from_utf8_lossy(&out).trim().to_string();
        if comm == "standing" {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(comm, "standing");
}
