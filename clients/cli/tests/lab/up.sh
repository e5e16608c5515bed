#!/bin/sh
# Control plane end to end: `tine up` (control plane + local executor), a snapshot made through
# the API, sandboxes spawned through the CLI and the Python client, evals in each, child
# networks (net.sh), cgroup limits (limits.sh), a hostile guest agent (hostile.sh), branches,
# metrics.
# Usage: up.sh TINE IMAGE WORKDIR PYTHON_VENV
set -u
T=$1 IMG=$2 W=$3 VENV=$4
PY=$(cd "$(dirname "$0")/../../../python" && pwd)
mkdir -p "$W"
ok() { echo "CHECK $1 ok"; }
fail() { echo "CHECK $1 FAIL $2"; }

# --net-no-masquerade: the test's "internet" routes the child links back, so its server sees
# each child's own address (net.sh). An hour's default lifetime: the lab is slow, and the
# expiry itself is checked with a short one (limits.sh).
"$T" up --data-dir "$W/data" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --executor-metrics-listen 127.0.0.1:0 --pool 4 --net-no-masquerade --sandbox-timeout-secs 3600 \
  >"$W/up.out" 2>"$W/up.err" &
UP=$!
i=0
while [ $i -lt 60 ] && ! grep -q TINE_TOKEN_FILE "$W/up.out"; do sleep 1; i=$((i + 1)); done
grep -q TINE_TOKEN_FILE "$W/up.out" && ok up || { fail up "$(cat "$W/up.err")"; exit 1; }
export $(cat "$W/up.out")

if "$T" snapshots create --tag py --image "$IMG" --eval 'parent_value = 21' >"$W/create" 2>&1; then
  ok snapshot-api
else
  fail snapshot-api "$(tail -5 "$W/create")"; kill $UP; exit 1
fi
cat "$W/create"

"$T" sandbox spawn --tag py -n 3 >"$W/spawn" 2>&1
cat "$W/spawn"
n=$(grep -c 'ready in' "$W/spawn")
[ "$n" = 3 ] && ok spawn-cli || fail spawn-cli "$n of 3 ready"
good=0
for id in $(grep 'ready in' "$W/spawn" | awk '{print $1}'); do
  v=$("$T" sandbox eval "$id" 'parent_value * 2' 2>&1)
  [ "$v" = 42 ] && good=$((good + 1))
done
[ "$good" = 3 ] && ok eval-cli || fail eval-cli "$good of 3 returned 42"
"$T" sandbox ls

. "$(dirname "$0")/net.sh"
. "$(dirname "$0")/limits.sh"
. "$(dirname "$0")/hostile.sh"

# The Python client: the example (3 sandboxes, eval in each) and the live test suite with spawning.
if "$VENV/bin/python" "$PY/examples/fork_and_eval.py" py -n 3 >"$W/py-example" 2>&1; then ok python-example
else fail python-example "$(tail -5 "$W/py-example")"; fi
cat "$W/py-example"
if TINE_TEST_TAG=py "$VENV/bin/python" "$PY/tests/test_client.py" >"$W/py-tests" 2>&1 \
   && grep -q ' 0 failed' "$W/py-tests" && ! grep -q ' [1-9][0-9]* skipped' "$W/py-tests"; then
  ok python-tests
else
  fail python-tests "$(tail -15 "$W/py-tests")"
fi
cat "$W/py-tests"

# Branch a running sandbox through the CLI, then fork from the branch: the child has the state
# set before the branch, and the source runs on.
"$T" sandbox spawn --tag py -n 1 >"$W/spawn-src" 2>&1
SRC=$(grep 'ready in' "$W/spawn-src" | awk '{print $1}')
"$T" sandbox eval "$SRC" 'mid_run = parent_value + 1' >/dev/null 2>&1
if "$T" sandbox branch "$SRC" --tag py-mid >"$W/branch" 2>&1 \
   && "$T" sandbox eval "$SRC" 'mid_run = 0' >/dev/null 2>&1 \
   && "$T" sandbox spawn --tag py-mid -n 2 >"$W/spawn-mid" 2>&1; then
  good=0
  for id in $(grep 'ready in' "$W/spawn-mid" | awk '{print $1}'); do
    [ "$("$T" sandbox eval "$id" 'mid_run' 2>&1)" = 22 ] && good=$((good + 1))
  done
  [ "$good" = 2 ] && [ "$("$T" sandbox eval "$SRC" 'mid_run' 2>&1)" = 0 ] && ok branch-cli \
    || fail branch-cli "$good of 2 children of the branch returned 22"
else
  fail branch-cli "$(tail -5 "$W/branch" "$W/spawn-mid" 2>/dev/null)"
fi
cat "$W/branch" "$W/spawn-mid"
"$T" snapshots get py-mid
# The source's wall clock is still right after its pause (and its rebase).
guest_now=$("$T" sandbox eval "$SRC" 'import time; int(time.time())' 2>&1)
case $guest_now in
  ''|*[!0-9]*) skew=unknown ;;
  *) skew=$(( guest_now - $(date +%s) )); skew=${skew#-} ;;
esac
if [ "$skew" != unknown ] && [ "$skew" -le 5 ]; then ok branch-source-clock
else fail branch-source-clock "guest time $guest_now, host $(date +%s)"; fi
# Without waiting: the answer comes once the source resumes (the snapshot WRITING unless it
# finished first), and a spawn right after waits for the snapshot, then has its state. The
# source was rebased onto py-mid, so this second branch is a diff over py-mid.
"$T" sandbox eval "$SRC" 'mid_run = 5' >/dev/null 2>&1
if "$T" sandbox branch "$SRC" --tag py-nw --mode live --no-wait >"$W/branch-nw" 2>&1 \
   && "$T" sandbox spawn --tag py-nw -n 1 >"$W/spawn-nw" 2>&1; then
  id=$(grep 'ready in' "$W/spawn-nw" | awk '{print $1}')
  if grep -Eq 'the snapshot is (WRITING|READY)' "$W/branch-nw" \
     && "$T" snapshots get py-nw | grep -q 'parent py-mid' \
     && [ "$("$T" sandbox eval "$id" 'mid_run' 2>&1)" = 5 ]; then ok branch-no-wait
  else fail branch-no-wait "$(tail -3 "$W/branch-nw" "$W/spawn-nw")"; fi
else
  fail branch-no-wait "$(tail -5 "$W/branch-nw" "$W/spawn-nw" 2>/dev/null)"
fi
cat "$W/branch-nw" "$W/spawn-nw"
"$T" snapshots get py-nw
if "$VENV/bin/python" "$PY/examples/branch_and_diverge.py" py >"$W/py-branch" 2>&1; then ok python-branch-demo
else fail python-branch-demo "$(tail -8 "$W/py-branch")"; fi
cat "$W/py-branch"

"$T" executors ls

# The executor's own metrics: where each spawn's time went (a histogram per phase).
EXM=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["executor_metrics"])' "$W/data/up.json")
python3 -c 'import sys,urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
  "http://$EXM/metrics" >"$W/executor-metrics" 2>&1
grep -E '^tine_executor_(spawn_phase_seconds_(sum|count)|pool_(idle|target)_workers|vms_running|spawn_failures_total|oom_kills_total)' "$W/executor-metrics"
n=$(sed -n 's/^tine_executor_spawn_phase_seconds_count{phase="restore"} //p' "$W/executor-metrics")
missing=""
for p in network handoff restore running agent fixup total; do
  grep -q "^tine_executor_spawn_phase_seconds_count{phase=\"$p\"} [1-9]" "$W/executor-metrics" || missing="$missing $p"
done
oom=$(sed -n 's/^tine_executor_oom_kills_total //p' "$W/executor-metrics")
# The pool's target: --pool 4, or grown (up to the default --pool-max 32) by spawns that found it short.
target=$(sed -n 's/^tine_executor_pool_target_workers //p' "$W/executor-metrics")
[ "${target:-0}" -ge 4 ] && [ "${target:-0}" -le 32 ] || missing="$missing pool-target(${target:-none})"
[ -z "$missing" ] && [ "${n:-0}" -ge 3 ] && [ "${oom:-0}" -ge 1 ] && ok executor-metrics \
  || fail executor-metrics "phases without observations:$missing (restore count ${n:-none}; oom kills ${oom:-none})"
kill -TERM $UP; wait $UP && ok shutdown || fail shutdown "tine up exited $?"
