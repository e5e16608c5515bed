//! Building the static agent binary for guest images.
//!
//! The machine only has the x86_64-unknown-linux-gnu target, so the agent is
//! linked statically against glibc (`+crt-static`). Passing `--target`
//! explicitly keeps RUSTFLAGS away from build scripts and proc macros (which
//! must stay dynamic) and puts the result in its own directory, so it never
//! overwrites or invalidates the ordinary `target/release/tine-agent`.
//! Equivalent shell command, from the workspace root:
//!
//! ```text
//! RUSTFLAGS="-C target-feature=+crt-static" \
//!   CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=true \
//!   cargo build --release -p tine-agent --bin tine-agent --target x86_64-unknown-linux-gnu
//! # → target/x86_64-unknown-linux-gnu/release/tine-agent
//! ```
//!
//! The agent avoids NSS (no user/host lookups), so static glibc is safe.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};

pub const TARGET: &str = "x86_64-unknown-linux-gnu";

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds (or reuses, if up to date) the static agent and returns its path.
pub fn static_agent_binary() -> anyhow::Result<PathBuf> {
    let root = workspace_root();
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .current_dir(&root)
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        // The workspace's release profile keeps debuginfo; a guest image
        // wants the small binary.
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
        .env("CARGO_PROFILE_RELEASE_STRIP", "true")
        .args([
            "build",
            "--release",
            "-p",
            "tine-agent",
            "--bin",
            "tine-agent",
            "--target",
            TARGET,
        ])
        .status()
        .context("running cargo to build the static tine-agent")?;
    if !status.success() {
        bail!("cargo build of the static tine-agent failed ({status})");
    }
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    let bin = target_dir.join(TARGET).join("release").join("tine-agent");
    if !bin.is_file() {
        bail!("static tine-agent not found at {}", bin.display());
    }
    Ok(bin)
}
