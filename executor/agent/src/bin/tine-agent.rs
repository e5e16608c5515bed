//! tine-agent: the guest agent. As PID 1 it also mounts the pseudo
//! filesystems, loads kernel modules and reaps orphans.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use tine_agent::config::{self, AgentConfig};
use tine_agent::server::listen::{ListenAddr, Listener, VSOCK_PORT};
use tine_agent::server::{init, modules, network, reaper, Agent};

#[derive(Parser)]
#[command(version, about = "Tine guest agent")]
struct Args {
    /// Where to listen: vsock:PORT or unix:PATH.
    #[arg(long, default_value_t = format!("vsock:{VSOCK_PORT}"))]
    listen: String,
    /// Config file (`key = value` lines; see tine_agent::config).
    #[arg(long, default_value = config::DEFAULT_PATH)]
    config: PathBuf,
}

fn main() {
    let pid1 = std::process::id() == 1;
    if pid1 {
        // Before any thread exists, so every thread inherits the mask.
        if let Err(e) = reaper::block_sigchld() {
            eprintln!("tine-agent: blocking SIGCHLD: {e}");
        }
        for (target, e) in init::mount_filesystems() {
            eprintln!("tine-agent: mounting {target}: {e}");
        }
        if std::env::var_os("PATH").is_none() {
            // SAFETY: still single-threaded.
            unsafe { std::env::set_var("PATH", tine_agent::server::exec::DEFAULT_PATH) };
        }
        if let Err(e) = reaper::start_reaper() {
            eprintln!("tine-agent: starting reaper: {e}");
        }
    }
    if let Err(e) = run(pid1) {
        eprintln!("tine-agent: {e:#}");
        if pid1 {
            // PID 1 exiting panics the kernel; stay up so the console shows why.
            loop {
                std::thread::park();
            }
        }
        std::process::exit(1);
    }
}

fn run(pid1: bool) -> anyhow::Result<()> {
    // As PID 1 our argv is whatever the kernel did not recognise on its command line
    // (e.g. `quiet`-style words): not ours to parse.
    let args = if pid1 {
        Args::parse_from(["tine-agent"])
    } else {
        Args::parse()
    };
    let addr: ListenAddr = args.listen.parse().map_err(anyhow::Error::msg)?;
    let cfg = AgentConfig::load(&args.config)?;
    match modules::load_modules(&cfg.modules) {
        Ok(loaded) if !loaded.is_empty() => {
            eprintln!("tine-agent: loaded modules: {}", loaded.join(" "))
        }
        Ok(_) => {}
        // Keep going: the listener below reports the consequence clearly.
        Err(e) => eprintln!("tine-agent: loading modules: {e}"),
    }
    if pid1 {
        configure_network();
    }
    let listener =
        Listener::bind(&addr).with_context(|| format!("listening on {}", args.listen))?;
    let agent = Agent::new(&cfg);
    agent.start_warmup();
    eprintln!(
        "tine-agent {} listening on {}",
        tine_agent::server::VERSION,
        args.listen
    );
    agent.serve(&listener).context("accepting connections")?;
    Ok(())
}

/// The network the host asked for on the kernel command line. A failure is reported on the
/// console and the agent carries on: the sandbox is still usable without a network.
fn configure_network() {
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let cfg = match network::parse_cmdline(&cmdline) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("tine-agent: network settings: {e}");
            None
        }
    };
    match network::configure(cfg.as_ref()) {
        Ok(Some(iface)) => {
            let c = cfg.expect("configured");
            eprintln!("tine-agent: {iface} is {}/{}", c.addr, c.prefix)
        }
        Ok(None) => {}
        Err(e) => eprintln!("tine-agent: configuring the network: {e}"),
    }
}
