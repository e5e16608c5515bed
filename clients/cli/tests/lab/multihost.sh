#!/bin/sh
# Several hosts against one S3-compatible store: a control plane, executors host-a, host-b
# (lazy fetch) and host-c (eager fetch), each with its own data directory and port standing
# for a host, and moto_server as the store. A snapshot made on host-a is spawned with spread
# onto all three; host-a is killed and spawns go on on the others; a branch made on host-c is
# forked on host-b; a corrupted store is refused
# by a fourth, cold executor while the others keep spawning.
# Usage: multihost.sh TINE IMAGE WORKDIR VENV   (VENV: moto_server and grpcurl, deploy/dev/setup.sh)
set -u
T=$1 IMG=$2 W=$3 VENV=$4
rm -rf "$W"; mkdir -p "$W"
# Each check says when it was reached (seconds since the start), so a slow run shows where.
T0=$(date +%s)
at() { echo "[multihost +$(($(date +%s) - T0)) s] $1"; }
ok() { echo "CHECK $1 ok"; at "$1"; }
fail() { echo "CHECK $1 FAIL $2"; at "$1"; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() { i=0; while [ $i -lt 100 ] && ! python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $1), 0.2)" 2>/dev/null; do sleep 0.2; i=$((i + 1)); done; }
PIDS=""
cleanup() { for p in $PIDS; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

# The store: moto_server with one bucket.
S3=$(port)
"$VENV/bin/moto_server" -H 127.0.0.1 -p "$S3" >"$W/moto.log" 2>&1 &
PIDS="$PIDS $!"
wait_port "$S3"
export AWS_ENDPOINT_URL=http://127.0.0.1:$S3 AWS_ALLOW_HTTP=true AWS_REGION=us-east-1 \
  AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test
S3PY="import boto3; s3 = boto3.client('s3', endpoint_url='$AWS_ENDPOINT_URL')"
"$VENV/bin/python" -c "$S3PY; s3.create_bucket(Bucket='tine')" && ok store || { fail store "$(tail -5 "$W/moto.log")"; exit 1; }
STORE=s3://tine/cluster

# The control plane.
# Token files are secrets (the executor refuses one others can read). Each executor has a
# token of its own, named executor:ID, which speaks for that id alone.
umask 077
"$T" token new --file "$W/tokens.json" --name ops --role admin >"$W/admin.token"
for h in host-a host-b host-c host-d; do
  "$T" token new --file "$W/tokens.json" --name "executor:$h" --role executor >"$W/$h.token"
done
umask 022
CP=$(port)
"$T" control-plane --listen "127.0.0.1:$CP" --db "$W/cp.db" --tokens "$W/tokens.json" \
  --sandbox-timeout-secs 3600 \
  --audit-log "$W/audit.log" --metrics-listen 127.0.0.1:0 >"$W/cp.out" 2>"$W/cp.err" &
PIDS="$PIDS $!"
wait_port "$CP"
export TINE_ADDR=http://127.0.0.1:$CP TINE_TOKEN
TINE_TOKEN=$(cat "$W/admin.token")

# Executors: one data directory and port each, one store.
executor() { # id fetch-mode
  p=$(port)
  "$T" executor --id "$1" --data-dir "$W/$1" --listen "127.0.0.1:$p" --metrics-listen 127.0.0.1:0 \
    --control-plane "http://127.0.0.1:$CP" --token-file "$W/$1.token" --pool 2 \
    --store "$STORE" --fetch "$2" >"$W/$1.out" 2>"$W/$1.err" &
  echo $! >"$W/$1.pid"
  PIDS="$PIDS $!"
  wait_port "$p"
}
executor host-a eager; executor host-b lazy; executor host-c eager
i=0
while [ $i -lt 60 ] && [ "$("$T" executors ls 2>/dev/null | grep -c 'host-[abc]')" -lt 3 ]; do sleep 0.5; i=$((i + 1)); done
"$T" executors ls
[ "$("$T" executors ls | grep -c 'host-[abc]')" = 3 ] && ok executors-registered || fail executors-registered "$(tail -3 "$W/host-a.err")"

if "$T" snapshots create --tag mh --image "$IMG" --eval 'parent_value = 777' --executor host-a >"$W/create" 2>&1; then
  ok snapshot-on-a
else
  fail snapshot-on-a "$(tail -5 "$W/create")"; exit 1
fi
cat "$W/create"
"$T" snapshots get mh | tee "$W/get"
grep -q '^  head  *blake3:' "$W/get" && ok layers-recorded || fail layers-recorded "no head digest"
# The same through the public gRPC API with a generic client.
"$VENV/bin/grpcurl" -plaintext -H "authorization: Bearer $TINE_TOKEN" -d '{"tag":"mh"}' \
  "127.0.0.1:$CP" tine.v1.Snapshots/GetSnapshot >"$W/grpcurl" 2>&1
cat "$W/grpcurl"
grep -q '"headDigest"' "$W/grpcurl" && grep -q '"compressedBytes"' "$W/grpcurl" && ok grpcurl-get-snapshot \
  || fail grpcurl-get-snapshot "$(head -5 "$W/grpcurl")"

# Twelve children, spread: every host gets some; b and c fetch the layers they lack.
"$T" sandbox spawn --tag mh -n 12 --policy spread --ready-timeout-ms 300000 >"$W/spawn12" 2>&1
cat "$W/spawn12"
n=$(grep -c 'ready in' "$W/spawn12")
[ "$n" = 12 ] && ok spawn-12 || fail spawn-12 "$n of 12 ready"
hosts=$(grep 'ready in' "$W/spawn12" | grep -o 'on host-[abc]' | sort -u | tr '\n' ' ')
[ "$hosts" = "on host-a on host-b on host-c " ] && ok spread-abc || fail spread-abc "children on: $hosts"
good=0
for id in $(grep 'ready in' "$W/spawn12" | awk '{print $1}'); do
  v=$("$T" sandbox eval "$id" 'parent_value' 2>&1)
  if [ "$v" = 777 ]; then good=$((good + 1)); else
    # What the child said and what its VMM and console last printed, to tell a guest that
    # died from a wrong page or a slow host.
    echo "eval in $id returned: $v"
    for d in "$W"/host-*/vms/"$id"; do
      [ -d "$d" ] || continue
      echo "--- $d/vmm.log"; tail -15 "$d/vmm.log" 2>/dev/null
      echo "--- $d/console.log"; tail -15 "$d/console.log" 2>/dev/null
    done
    grep -h "$id" "$W"/host-*.err | tail -10
  fi
done
[ "$good" = 12 ] && ok parent-value-everywhere || fail parent-value-everywhere "$good of 12 returned 777"
grep -h 'fetched snapshot from the store\|serving snapshot lazily' "$W"/host-*.err
grep -q 'serving snapshot lazily' "$W/host-b.err" && grep -q 'fetched snapshot from the store' "$W/host-c.err" \
  && ! grep -q 'fetched snapshot from the store\|serving snapshot lazily' "$W/host-a.err" && ok fetched-what-lacked \
  || fail fetched-what-lacked "fetch log lines missing or host-a fetched its own snapshot"

# host-a dies: once the control plane counts it lost, spawns go on on b and c.
kill -KILL "$(cat "$W/host-a.pid")"
i=0
while [ $i -lt 90 ] && "$T" executors ls | grep 'host-a' | grep -q ' up '; do sleep 1; i=$((i + 1)); done
"$T" executors ls
"$T" sandbox spawn --tag mh -n 4 --policy spread --ready-timeout-ms 300000 >"$W/spawn4" 2>&1
cat "$W/spawn4"
n=$(grep -c 'ready in' "$W/spawn4")
[ "$n" = 4 ] && ! grep 'ready in' "$W/spawn4" | grep -q 'on host-a' && ok a-down-spawns-on-bc || fail a-down-spawns-on-bc "$n of 4 ready"

# Objects in the store corrupted (the eight smallest; a whole-image
# fetch of a cold host meets them): a fourth, cold executor (eager) refuses them, naming the
# snapshot and the object, and caches nothing; b and c, which have the snapshot, are unaffected.
"$VENV/bin/python" - <<EOF
$S3PY
objs = []
for page in s3.get_paginator('list_objects_v2').paginate(Bucket='tine', Prefix='cluster/chunks/'):
    objs += page.get('Contents', [])
for o in sorted(objs, key=lambda o: o['Size'])[:8]:
    body = bytearray(s3.get_object(Bucket='tine', Key=o['Key'])['Body'].read())
    body[len(body) // 2] ^= 0xff
    s3.put_object(Bucket='tine', Key=o['Key'], Body=bytes(body))
print(f"corrupted 8 of {len(objs)} objects in the store")
EOF
executor host-d eager
i=0
while [ $i -lt 60 ] && ! "$T" executors ls 2>/dev/null | grep -q 'host-d'; do sleep 0.5; i=$((i + 1)); done
"$T" sandbox spawn --tag mh -n 1 --executor host-d --ready-timeout-ms 120000 >"$W/spawn-d" 2>&1
cat "$W/spawn-d"
chunks=$(find "$W/host-d/layers/chunks" -type f 2>/dev/null | wc -l)
grep -q 'ready in' "$W/spawn-d" && fail corrupt-refused "a child became ready from corrupt chunks"
grep -q 'snapshot mh' "$W/spawn-d" && grep -q 'failed verification' "$W/spawn-d" && [ "$chunks" = 0 ] \
  && ok corrupt-refused || fail corrupt-refused "error does not name the snapshot and a failed object, or $chunks objects cached"
"$T" sandbox spawn --tag mh -n 2 --executor host-b --executor host-c --ready-timeout-ms 300000 >"$W/spawn-bc" 2>&1
cat "$W/spawn-bc"
[ "$(grep -c 'ready in' "$W/spawn-bc")" = 2 ] && ok others-unaffected || fail others-unaffected "$(tail -2 "$W/spawn-bc")"

# A branch of a child on host-c is a diff layer in the store (new objects, intact): host-b,
# which has the parent, fetches only the branch and forks it from that instant.
"$T" sandbox spawn --tag mh -n 1 --executor host-c --ready-timeout-ms 300000 >"$W/spawn-src" 2>&1
SRC=$(grep 'ready in' "$W/spawn-src" | awk '{print $1}')
"$T" sandbox eval "$SRC" 'branch_value = parent_value + 1' >/dev/null 2>&1
# The branch through the public API with a generic gRPC client (LIVE: paused only to save the
# state and fork the VMM; no_wait: the answer comes once the source resumes). The spawn on
# host-b waits until the branch is written and in the store; then the branch's record: its
# parent and its two-layer chain.
"$VENV/bin/grpcurl" -plaintext -H "authorization: Bearer $TINE_TOKEN" \
  -d "{\"sandbox_id\":\"$SRC\",\"tag\":\"mh-b\",\"mode\":\"BRANCH_MODE_LIVE\",\"no_wait\":true}" \
  "127.0.0.1:$CP" tine.v1.Sandboxes/Branch >"$W/branch" 2>&1
"$T" sandbox spawn --tag mh-b -n 2 --executor host-b --ready-timeout-ms 300000 >"$W/spawn-branch" 2>&1
spawned=$?
"$VENV/bin/grpcurl" -plaintext -H "authorization: Bearer $TINE_TOKEN" -d '{"tag":"mh-b"}' \
  "127.0.0.1:$CP" tine.v1.Snapshots/GetSnapshot >"$W/get-branch" 2>&1
cat "$W/get-branch"
links=$(python3 -c 'import json,sys; print(len(json.load(open(sys.argv[1]))["snapshot"]["layers"]["chain"]))' "$W/get-branch" 2>/dev/null)
if grep -q '"parentTag": "mh"' "$W/branch" && grep -q '"pauseUs"' "$W/branch" && [ "$links" = 2 ] \
   && [ "$spawned" = 0 ]; then
  good=0
  for id in $(grep 'ready in' "$W/spawn-branch" | awk '{print $1}'); do
    [ "$("$T" sandbox eval "$id" 'branch_value' 2>&1)" = 778 ] && good=$((good + 1))
  done
  [ "$good" = 2 ] && ok branch-on-c-forked-on-b || fail branch-on-c-forked-on-b "$good of 2 children on host-b returned 778"
else
  fail branch-on-c-forked-on-b "chain of $links layer(s); $(tail -3 "$W/branch" "$W/spawn-branch" 2>/dev/null)"
fi
cat "$W/branch" "$W/spawn-branch"
"$T" snapshots get mh-b
