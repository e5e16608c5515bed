//! `cargo run -p tine-lab --example lab -- sh -c 'ls -l /dev/kvm'`: `tine lab` without the
//! full `tine` binary.

use clap::Parser;

#[derive(Parser)]
struct Args {
    #[command(flatten)]
    lab: tine_lab::cli::LabArgs,
}

fn main() -> anyhow::Result<()> {
    let code = tine_lab::cli::run(Args::parse().lab)?;
    std::process::exit(code);
}
