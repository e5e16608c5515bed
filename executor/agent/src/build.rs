//! The static agent binary that guest images carry is a build artifact, not something `tine`
//! compiles: `deploy/build.sh [OUTDIR]` (default `target/dist`) builds `tine` and the static
//! `tine-agent` side by side, and `tine image build` takes the agent from `--agent PATH` or
//! from beside the running `tine`. `deploy/build.sh --agent-only [OUTDIR]` builds just the
//! agent (what tests use). The agent build, as the script runs it from the workspace root:
//!
//! ```text
//! RUSTFLAGS="-C target-feature=+crt-static" \
//!   CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=true \
//!   cargo build --release -p tine-agent --bin tine-agent --target x86_64-unknown-linux-gnu
//! # → target/x86_64-unknown-linux-gnu/release/tine-agent (static-pie)
//! ```
//!
//! The machine only has the x86_64-unknown-linux-gnu target, so the agent is linked statically
//! against glibc (`+crt-static`); the guest has no dynamic loader. Passing `--target` keeps
//! RUSTFLAGS away from build scripts and proc macros (which must stay dynamic) and puts the
//! result in its own directory, so it never overwrites the ordinary `target/release/tine-agent`.
//! The agent avoids NSS (no user/host lookups), so static glibc is safe.

/// The agent's file name; `tine image build` looks for it beside the running `tine`.
pub const BINARY_NAME: &str = "tine-agent";

/// For tests that build guest images: `$TINE_AGENT_BIN` (deploy/dev/test.sh builds the agent
/// once and sets it), else the agent built here, once per test process, by
/// `deploy/build.sh --agent-only` into `<target>/dist`. Only with the `test-build` feature,
/// which only dev-dependencies enable: `tine` itself never runs a build.
#[cfg(feature = "test-build")]
pub fn static_agent_for_tests() -> &'static std::path::Path {
    static AGENT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    AGENT.get_or_init(|| built_for_tests("TINE_AGENT_BIN", "--agent-only", BINARY_NAME))
}

/// The agent with the `hostile` feature (`deploy/build.sh --hostile-agent`), for the lab's
/// hostile-guest scenario: `$TINE_HOSTILE_AGENT_BIN`, else built here once per test process.
#[cfg(feature = "test-build")]
pub fn static_hostile_agent_for_tests() -> &'static std::path::Path {
    static AGENT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    AGENT.get_or_init(|| {
        built_for_tests(
            "TINE_HOSTILE_AGENT_BIN",
            "--hostile-agent",
            "tine-agent-hostile",
        )
    })
}

#[cfg(feature = "test-build")]
fn built_for_tests(env: &str, flag: &str, name: &str) -> std::path::PathBuf {
    use std::path::{Path, PathBuf};
    if let Some(p) = std::env::var_os(env) {
        return PathBuf::from(p);
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("dist");
    let status = std::process::Command::new("bash")
        .arg(root.join("deploy/build.sh"))
        .arg(flag)
        .arg(&out)
        .status()
        .expect("running deploy/build.sh");
    assert!(status.success(), "deploy/build.sh {flag}: {status}");
    out.join(name)
}
