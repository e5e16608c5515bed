//! `tine-vmm-worker __vmm-worker`: the VMM worker on its own, which executors start instead of
//! `tine __vmm-worker` when it is installed beside `tine`.
//!
//! The same code, in a binary that holds only it. A position-independent executable's
//! relocated data is written at load, so every worker process has a private copy of it: for
//! `tine`, which holds the CLI, the control plane and the executor daemon, that is most of a
//! MiB per child; for this binary, a fraction of it.

use std::process::ExitCode;

#[path = "../stderr_log.rs"]
mod stderr_log;

fn main() -> ExitCode {
    if std::env::args().nth(1).as_deref() != Some(tine_host::worker::WORKER_SUBCOMMAND) {
        eprintln!(
            "usage: tine-vmm-worker {}  (started by a Tine executor, which hands it a job on stdin)",
            tine_host::worker::WORKER_SUBCOMMAND
        );
        return ExitCode::from(2);
    }
    // Warnings go to stderr, which is the child's vmm.log once a job is read. With `RUST_LOG`
    // set, through tracing-subscriber as `tine`'s do; otherwise through a logger that holds
    // nothing, since every child's VMM pays for its logger's memory (worker_log).
    if std::env::var_os("RUST_LOG").is_some() {
        stderr_log::init();
    } else if let Err(e) = tine_host::worker_log::init() {
        eprintln!("tine-vmm-worker: no log: {e}");
    }
    match tine_host::worker_main() {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            // One line, control characters escaped: the log is read by people and tools.
            eprintln!(
                "tine-vmm-worker: error: {}",
                format!("{e:#}").escape_default()
            );
            ExitCode::from(1)
        }
    }
}
