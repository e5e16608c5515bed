#!/usr/bin/env bash
# Everything CI checks: formatting, lints, unit and integration tests (including tests on
# /dev/kvm with hand-made guests), then the Linux boot tests inside the nested KVM lab.
set -euo pipefail
cd "$(dirname "$0")/../.."

bash deploy/dev/setup.sh
export PATH="${TINE_VENV:-$HOME/.cache/tine/venv}/bin:$PATH"

echo "== fmt"; cargo fmt --all -- --check
echo "== clippy"; cargo clippy --workspace --all-targets -- -D warnings
echo "== unit and integration tests"; cargo test --workspace
echo "== API end to end: tine up + grpcurl + tine CLI + the Python client"
cargo test -p tine-cli --test api -- --ignored
echo "== lab tests (boot Linux under real KVM inside the nested lab)"
# The standalone warm-eval scenario is left out of CI for now: booting the python-numpy image
# through a separate `tine run` process intermittently leaves an idle guest that never answers
# its agent (open; see docs/fork.md). The fork scenario boots the same image and evals in every
# child. Run it by hand: cargo test -p tine-cli --test lab -- --ignored warm_numpy --nocapture
cargo test -p tine-cli --test lab -- --ignored --test-threads=1 --skip warm_numpy_eval
