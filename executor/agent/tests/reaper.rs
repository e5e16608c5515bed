//! The PID 1 reaper collects orphans without stealing owned children's
//! statuses. Runs in its own test binary because it makes this process a
//! child subreaper (standing in for PID 1).

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use tine_agent::server::reaper::{reap_orphans, spawn_owned};

fn state(pid: u32) -> Option<String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(
        stat.rsplit_once(')')?
            .1
            .split_whitespace()
            .next()?
            .to_owned(),
    )
}

#[test]
fn orphans_are_reaped_owned_children_keep_their_status() {
    // SAFETY: prctl with integer arguments.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) },
        0
    );

    let mut owned = spawn_owned(Command::new("sh").args(["-c", "exit 5"])).unwrap();
    // The background `cat` outlives its parent (it waits for EOF on a pipe we
    // hold), so it is reparented to us rather than reaped by the shell.
    let mut parent = spawn_owned(
        Command::new("sh")
            .args(["-c", "exec 3<&0; cat <&3 >/dev/null & echo $!"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped()),
    )
    .unwrap();
    let feed = parent.stdin.take().unwrap();
    let mut out = String::new();
    parent
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(parent.wait().unwrap().success());
    let orphan: u32 = out.trim().parse().unwrap();
    drop(feed); // now the orphan exits

    // Both are (or become) zombies; loop until the orphan is gone.
    while state(owned.id()).as_deref() != Some("Z") {
        std::thread::yield_now();
    }
    let mut reaped = 0;
    while Path::new(&format!("/proc/{orphan}")).exists() {
        reaped += reap_orphans();
        std::thread::yield_now();
    }
    assert!(
        reaped >= 1,
        "the orphan was reparented to us and reaped by us"
    );
    // The owned zombie was left alone: its status is still ours to collect.
    assert_eq!(owned.wait().unwrap().code(), Some(5));
}

/// An owner that drops a child that has already exited leaves no zombie: the handle collects
/// it, because its SIGCHLD came while it was owned and no other may come.
#[test]
fn a_dropped_handle_collects_its_exited_child() {
    let child = spawn_owned(&mut Command::new("true")).unwrap();
    let pid = child.id();
    while state(pid).as_deref() != Some("Z") {
        std::thread::yield_now();
    }
    drop(child);
    assert_eq!(state(pid), None, "no zombie left behind");
}
