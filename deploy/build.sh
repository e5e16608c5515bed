#!/usr/bin/env bash
# The release build: `tine`, its VMM worker `tine-vmm-worker` and the static guest agent `tine-agent`,
# side by side in OUTDIR
# (default: target/dist in the checkout). `tine image build` takes the agent from beside the
# running `tine`, so the two files copied together build images on a machine with no checkout
# and no Rust toolchain.
#
# Usage: deploy/build.sh [--agent-only | --hostile-agent] [OUTDIR]
#   --agent-only     build only the static tine-agent (what the tests use)
#   --hostile-agent  build only tine-agent-hostile: the agent with the `hostile` feature, which
#                    breaches the protocol on request (the lab's hostile-guest scenario; never
#                    shipped)
set -euo pipefail

agent_only=0 features=() name=tine-agent
case "${1:-}" in
  --agent-only) agent_only=1; shift ;;
  --hostile-agent) agent_only=1 features=(--features hostile) name=tine-agent-hostile; shift ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
# OUTDIR is relative to the caller's directory; the default lives in the checkout.
out=$(realpath -m "${1:-$root/target/dist}")
cargo=${CARGO:-cargo}
target_dir=$(cd "$root" && realpath -m "${CARGO_TARGET_DIR:-target}")
cd "$root"

if [ $agent_only = 0 ]; then
  "$cargo" build --release -p tine-cli --bin tine --bin tine-vmm-worker
fi
# The guest has no dynamic loader, so glibc is linked in statically. With an explicit --target,
# RUSTFLAGS reach only the target's crates, not build scripts and proc macros (which must stay
# dynamic), and the output gets its own directory instead of replacing target/release/tine-agent.
# The workspace's release profile keeps debuginfo; a guest image wants the small binary.
RUSTFLAGS="-C target-feature=+crt-static" \
  CARGO_PROFILE_RELEASE_DEBUG=false CARGO_PROFILE_RELEASE_STRIP=true \
  "$cargo" build --release -p tine-agent --bin tine-agent --target x86_64-unknown-linux-gnu \
  "${features[@]}"

mkdir -p "$out"
# Copy, then rename: a binary that is running (or being read by a concurrent test) is replaced,
# never rewritten in place.
place() {
  cp "$1" "$out/.$2.tmp.$$"
  chmod 755 "$out/.$2.tmp.$$"
  mv -f "$out/.$2.tmp.$$" "$out/$2"
  printf '  %s (%s KiB)\n' "$out/$2" $(( $(stat -c %s "$out/$2") / 1024 ))
}
echo "deploy/build.sh: built"
if [ $agent_only = 0 ]; then
  place "$target_dir/release/tine" tine
  # Executors start their VMM workers from it (else from `tine` itself).
  place "$target_dir/release/tine-vmm-worker" tine-vmm-worker
fi
place "$target_dir/x86_64-unknown-linux-gnu/release/tine-agent" "$name"
