#!/usr/bin/env bash
# Everything CI checks: formatting, lints, unit and integration tests (including tests on
# /dev/kvm with hand-made guests), then the Linux boot tests inside the nested KVM lab.
set -euo pipefail
cd "$(dirname "$0")/../.."

bash deploy/dev/setup.sh
# A full run builds once from scratch: incremental caches would only double the disk it needs.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
export PATH="${TINE_VENV:-$HOME/.cache/tine/venv}/bin:$PATH"
# Each step says when it began, in seconds from the start: CI must end well inside 90 minutes.
step() { echo "== $* (+${SECONDS} s)"; }

step "fmt"; cargo fmt --all -- --check
step "clippy"; cargo clippy --workspace --all-targets -- -D warnings
step "static guest agent"; bash deploy/build.sh --agent-only target/dist
export TINE_AGENT_BIN="$PWD/target/dist/tine-agent"
# The agent that breaches the protocol on request, for the lab's hostile-guest scenario.
bash deploy/build.sh --hostile-agent target/dist
export TINE_HOSTILE_AGENT_BIN="$PWD/target/dist/tine-agent-hostile"
step "unit and integration tests"; cargo test --workspace
step "API end to end: tine up + grpcurl + tine CLI + the Python client"
cargo test -p tine-cli --test api -- --ignored
step "fuzzing (bounded: TINE_FUZZ_SECS per target)"; bash fuzz/run.sh
# The host crate's test binary, for the cgroup test the lab runs (same features as above).
TINE_HOST_TEST_BIN=$(cargo test --workspace --no-run --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "host" \
            and m["target"]["kind"] == ["test"] and m.get("executable"):
        print(m["executable"])')
export TINE_HOST_TEST_BIN
step "lab tests (boot Linux under real KVM inside the nested lab)"
cargo test -p tine-cli --test lab -- --ignored --test-threads=1
step done
