//! `cargo run -p tine-image --example image -- kernel --flavor cloud` etc.: the `tine image`
//! subcommands without the full `tine` binary.

use clap::Parser;

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: tine_image::cli::ImageCommand,
}

fn main() -> anyhow::Result<()> {
    tine_image::cli::run(Args::parse().cmd)
}
