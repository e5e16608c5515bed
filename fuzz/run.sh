#!/usr/bin/env bash
# Build the fuzz targets (cargo-fuzz, libFuzzer, AddressSanitizer; needs the nightly toolchain)
# and run each for a bounded time. CI runs this with the defaults.
#
#   bash fuzz/run.sh                 every target, TINE_FUZZ_SECS (default 30) seconds each
#   bash fuzz/run.sh pack 600        one target, ten minutes
#
# Targets build unoptimised (`--dev`) with debug assertions on, so an overflow is a crash too:
# that halves CI's build (about 4.5 of 9 minutes from scratch) for fewer runs per second.
# TINE_FUZZ_RELEASE=1 builds them optimised, for long runs.
#
# Corpora grow in fuzz/corpus/TARGET (kept between local runs, not committed); a crash is
# saved in fuzz/artifacts/TARGET/ and replays with `cargo +nightly fuzz run --dev TARGET FILE`.
# Each crash found so far became a regression test next to the code it broke (see
# docs/security.md, "Fuzzing").
set -euo pipefail
cd "$(dirname "$0")"

targets=(agent_frames layer_manifest pack virtio_vsock)
secs=${TINE_FUZZ_SECS:-30}
profile=(--dev)
if [[ "${TINE_FUZZ_RELEASE:-0}" == 1 ]]; then
  profile=()
fi
if (( $# > 0 )); then
  targets=("$1")
  secs=${2:-$secs}
fi

# cargo-fuzz is installed once into Tine's cache (as the lab's kernels are).
tools="${TINE_CACHE_DIR:-$HOME/.cache/tine}/tools"
export PATH="$tools/bin:$PATH"
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz into $tools"
  cargo +nightly install cargo-fuzz --version 0.13.2 --locked --root "$tools"
fi

echo "== building ${#targets[@]} fuzz targets"
for t in "${targets[@]}"; do
  cargo +nightly fuzz build "${profile[@]}" "$t"
done

failed=()
printf '%-16s %8s %10s %10s  %s\n' TARGET SECONDS RUNS COVERAGE RESULT
for t in "${targets[@]}"; do
  mkdir -p "corpus/$t"
  log=$(mktemp)
  if cargo +nightly fuzz run "${profile[@]}" "$t" "corpus/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 >"$log" 2>&1; then
    result=ok
  else
    result="FAILED (see fuzz/artifacts/$t)"
    failed+=("$t")
    tail -40 "$log"
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
  printf '%-16s %8s %10s %10s  %s\n' "$t" "$secs" "${runs:-?}" "${cov:-?}" "$result"
  rm -f "$log"
done
if (( ${#failed[@]} > 0 )); then
  echo "fuzz: ${failed[*]} found a crash" >&2
  exit 1
fi
