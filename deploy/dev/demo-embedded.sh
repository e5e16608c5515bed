#!/bin/sh
# The main job on the embedded default: `tine up` (control plane + local executor, SQLite and
# snapshots under one data directory), a warm python-numpy snapshot made through the API, ten
# children forked from it, Python evaluated in each, then everything stopped.
# Usage: demo-embedded.sh TINE [N]   (run directly on a VMX/SVM host, or inside `tine lab`)
set -eu
T=$1 N=${2:-10}
D=$(mktemp -d /tmp/tine-demo.XXXXXX)
"$T" up --data-dir "$D" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 >"$D/up.out" 2>"$D/up.err" &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null; rm -rf "$D"' EXIT
i=0
while [ $i -lt 60 ] && ! grep -q TINE_TOKEN_FILE "$D/up.out"; do sleep 1; i=$((i + 1)); done
cat "$D/up.err"
export $(cat "$D/up.out")
echo "== snapshot: boot python-numpy, import numpy (warm-up), set parent_value, snapshot"
"$T" snapshots create --tag demo --image python-numpy --eval 'parent_value = 21'
echo "== fork $N children"
"$T" sandbox spawn --tag demo -n "$N" --sandbox-timeout-secs 1800 | tee "$D/spawn"
echo "== eval in each child (numpy already imported; parent_value inherited)"
for id in $(grep 'ready in' "$D/spawn" | awk '{print $1}'); do
  printf '%s: ' "$id"
  "$T" sandbox eval "$id" 'f"{parent_value * 2} numpy {numpy.__version__}"'
done
"$T" sandbox ls
"$T" executors ls
