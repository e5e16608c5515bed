//! The `tine_agent::cli` commands as a standalone tool, for manual testing
//! until they are wired into `tine`:
//!
//!   cargo run -p tine-agent --example agent-cli -- --agent-unix /tmp/a.sock exec -- uname -a

use clap::Parser;
use tine_agent::cli::{run, AgentCli};

fn main() {
    let cli = AgentCli::parse();
    match run(&cli) {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("tine: {e:#}");
            std::process::exit(1);
        }
    }
}
