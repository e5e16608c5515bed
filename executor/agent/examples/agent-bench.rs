//! Agent latency benchmark (same as `tine bench agent`).
//!
//!   cargo run --release -p tine-agent --example agent-bench -- --socket /path/vm.vsock
//!   cargo run --release -p tine-agent --example agent-bench -- --agent-unix /tmp/agent.sock

use clap::Parser;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    bench: tine_agent::bench::BenchArgs,
}

fn main() -> anyhow::Result<()> {
    tine_agent::bench::run(&Args::parse().bench)
}
