//! `tine`: fork(2) for microVMs — the command-line interface.

mod bench;
mod bench_branch;
mod bench_burst;
mod bench_fetch;
mod bench_net;
mod bench_pages;
mod bench_slab;
mod defaults;
mod doctor;
mod fork;
mod local;
mod remote;
mod restore;
mod run;
mod serve;
mod stderr_log;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "tine",
    version,
    about = "fork(2) for microVMs",
    propagate_version = true
)]
struct Cli {
    /// Which VM's agent `exec`, `eval`, `cp` and `ping` talk to.
    #[command(flatten)]
    agent: tine_agent::cli::AgentTarget,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check this host for everything Tine needs, with a fix for each problem.
    Doctor(doctor::DoctorArgs),
    /// Boot a VM from a kernel and initramfs and stream its serial console.
    Run(run::RunArgs),
    /// Boot an image, wait for its agent to be ready (warm), and snapshot it under a tag.
    Snapshot(fork::SnapshotArgs),
    /// Fork N children from a snapshot; prints each child as it becomes ready.
    Fork(fork::ForkArgs),
    /// List running VMs.
    Ls(fork::LsArgs),
    /// Kill VMs.
    Kill(fork::KillArgs),
    /// Resume a VM from a snapshot directory.
    Restore(restore::RestoreArgs),
    /// Guest kernels and images: fetch Debian kernels, build initramfs images.
    #[command(subcommand)]
    Image(tine_image::cli::ImageCommand),
    /// Run a command inside the nested KVM lab (QEMU with an emulated SVM CPU).
    Lab(tine_lab::cli::LabArgs),
    #[command(flatten)]
    Agent(tine_agent::cli::AgentCommand),
    #[command(flatten)]
    Store(tine_snapshot_store::cli::StoreCommand),
    /// Start the embedded default: control plane + local executor in one process.
    Up(serve::UpArgs),
    /// Run the control plane (multi-host deployments).
    ControlPlane(serve::ControlPlaneArgs),
    /// Run an executor daemon on this KVM host (multi-host deployments).
    Executor(serve::ExecutorArgs),
    /// Bearer tokens for the control plane.
    #[command(subcommand)]
    Token(serve::TokenCommand),
    /// Sandboxes through the control plane (TINE_ADDR, TINE_TOKEN).
    #[command(subcommand, visible_alias = "sb")]
    Sandbox(remote::SandboxCommand),
    /// Snapshots and their lineage through the control plane.
    #[command(subcommand)]
    Snapshots(remote::SnapshotsCommand),
    /// Executor hosts known to the control plane.
    #[command(subcommand)]
    Executors(remote::ExecutorsCommand),
    /// (internal) A pre-started VMM process waiting for a snapshot to restore.
    #[command(name = "__vmm-worker", hide = true)]
    VmmWorker {
        /// Fork workers on request instead (read by the worker itself).
        #[arg(long)]
        zygote: bool,
    },
    /// Benchmarks that print figures and how they were measured.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // The services set up their own logging and tracing (with OTLP export when configured).
    if !matches!(
        cli.command,
        Command::Up(_) | Command::ControlPlane(_) | Command::Executor(_)
    ) {
        stderr_log::init();
    }
    let result = match cli.command {
        Command::Doctor(a) => doctor::run(a),
        Command::Run(a) => run::run(a),
        Command::Restore(a) => restore::run(a),
        Command::Snapshot(a) => fork::snapshot(a),
        Command::Fork(a) => fork::fork(a),
        Command::Ls(a) => fork::ls(a),
        Command::Kill(a) => fork::kill(a),
        Command::Image(c) => tine_image::cli::run(c).map(|()| 0),
        Command::Lab(a) => tine_lab::cli::run(a),
        Command::Bench(c) => bench::run(c),
        Command::Up(a) => serve::up(a),
        Command::ControlPlane(a) => serve::control_plane(a),
        Command::Executor(a) => serve::executor(a),
        Command::Token(c) => serve::token(c),
        Command::Sandbox(c) => remote::sandbox(c),
        Command::Snapshots(c) => remote::snapshots(c),
        Command::Executors(c) => remote::executors(c),
        Command::VmmWorker { .. } => tine_host::worker_main(),
        Command::Store(c) => tine_snapshot_store::cli::run_blocking(c).map(|()| 0),
        Command::Agent(c) => tine_agent::cli::run_with(
            &cli.agent,
            &c,
            &mut std::io::stdout(),
            &mut std::io::stderr(),
        ),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("tine: error: {}", printable(&format!("{e:#}")));
            ExitCode::from(1)
        }
    }
}

/// An error's text for a terminal: control characters, which may come from a pack, a server
/// or a guest (an escape sequence that rewrites the screen), are shown escaped; newlines and
/// tabs stay.
fn printable(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() && c != '\n' && c != '\t' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn errors_reach_the_terminal_without_control_characters() {
        assert_eq!(
            super::printable("pack \"\x1b[2J\x07x\u{9b}31m\"\n\tnext"),
            "pack \"\\u{1b}[2J\\u{7}x\\u{9b}31m\"\n\tnext"
        );
    }
}
