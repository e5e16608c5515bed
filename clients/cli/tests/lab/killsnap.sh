#!/bin/sh
# kill -9 while CreateSnapshot's booted parent writes its snapshot: first the executor, then
# the control plane (each a process of its own, as on a cluster). After each restart: no
# snapshot that looks complete under the tag, the control plane's record FAILED with the
# reason (never missing, never READY), the parent's VMM gone, nothing of ours left running;
# then the same create succeeds and a child of it answers.
# Usage: killsnap.sh TINE IMAGE WORKDIR
set -u
T=$1 IMG=$2 W=$3
rm -rf "$W"; mkdir -p "$W"
ok() { echo "CHECK $1 ok"; }
fail() { echo "CHECK $1 FAIL $2"; }
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() { i=0; while [ $i -lt 100 ] && ! python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $1), 0.2)" 2>/dev/null; do sleep 0.2; i=$((i + 1)); done; }
CPPID="" EXPID=""
cleanup() { for p in $CPPID $EXPID; do kill "$p" 2>/dev/null; done; wait 2>/dev/null; }
trap cleanup EXIT

umask 077
"$T" token new --file "$W/tokens.json" --name ops --role admin >"$W/admin.token"
"$T" token new --file "$W/tokens.json" --name executor:ex1 --role executor >"$W/ex1.token"
umask 022
CP=$(port) EXP=$(port)
export TINE_ADDR=http://127.0.0.1:$CP TINE_TOKEN
TINE_TOKEN=$(cat "$W/admin.token")
SN=$W/ex1/snapshots

start_cp() {
  "$T" control-plane --listen "127.0.0.1:$CP" --db "$W/cp.db" --tokens "$W/tokens.json" \
    --audit-log "$W/audit.log" >>"$W/cp.err" 2>&1 &
  CPPID=$!
  wait_port "$CP"
}
registrations() { grep -c 'executor registered' "$W/cp.err"; }
# Start the executor and wait (60 s) for the control plane to have registered it once more.
start_ex() {
  before=$(registrations)
  "$T" executor --id ex1 --data-dir "$W/ex1" --listen "127.0.0.1:$EXP" \
    --control-plane "http://127.0.0.1:$CP" --token-file "$W/ex1.token" --pool 1 >>"$W/ex1.err" 2>&1 &
  EXPID=$!
  wait_for_registration "$before"
}
wait_for_registration() {
  i=0
  while [ $i -lt 120 ] && [ "$(registrations)" -le "$1" ]; do sleep 0.5; i=$((i + 1)); done
  [ "$(registrations)" -gt "$1" ]
}
# Wait (up to $1 s) until the VMM of tag $2's parent is writing its memory into its staging
# directory (its header, written last, not there yet). Globs only: no process per poll.
wait_writing() {
  end=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$end" ]; do
    for d in "$SN"/.partial-parent-"$2"-*; do
      [ -e "$d/memory.img" ] && [ ! -e "$d/snapshot.json" ] && { echo "writing: $d"; return 0; }
    done
    sleep 0.02
  done
  return 1
}
# Pids of every process in $1's tree (itself included).
tree() {
  out=$1
  for c in $(cat "/proc/$1/task/"*/children 2>/dev/null); do out="$out $(tree "$c")"; done
  echo "$out"
}
alive() { n=""; for p in $1; do [ -e "/proc/$p" ] && n="$n $p"; done; echo "$n"; }
# What a killed create must not leave: the tag's snapshot directory on the executor.
no_complete_copy() { [ ! -e "$SN/$1" ]; }
state_of() { "$T" snapshots get "$1" 2>&1 | head -1; }
# Spawn one child of $1 and run a command in it.
child_answers() {
  "$T" sandbox spawn --tag "$1" -n 1 --ready-timeout-ms 300000 >"$W/spawn-$1" 2>&1
  id=$(grep 'ready in' "$W/spawn-$1" | awk '{print $1}')
  [ -n "$id" ] && [ "$("$T" sandbox exec "$id" -- echo "child-of-$1" 2>&1)" = "child-of-$1" ]
}

start_cp
start_ex && ok executor-registered || { fail executor-registered "$(tail -5 "$W/ex1.err")"; exit 1; }

# 1. The executor is killed while the parent writes.
"$T" snapshots create --tag k1 --image "$IMG" --executor ex1 >"$W/create-k1" 2>&1 &
CREATE=$!
if wait_writing 600 k1; then ok writing-1; else fail writing-1 "the parent never wrote: $(tail -5 "$W/create-k1") $(tail -5 "$W/ex1.err")"; exit 1; fi
ours=$(tree "$EXPID")
kill -9 "$EXPID"
wait "$CREATE"; rc=$?
cat "$W/create-k1"
# The caller is told which executor went away, as UNAVAILABLE (worth retrying).
[ $rc != 0 ] && grep -q 'UNAVAILABLE: executor ex1 stopped answering' "$W/create-k1" && ok create-1-fails \
  || fail create-1-fails "rc $rc: $(cat "$W/create-k1")"
no_complete_copy k1 && ok no-copy-1 || fail no-copy-1 "$(ls -la "$SN/k1")"
s=$(state_of k1); echo "after the executor's kill: $s"
case "$s" in *FAILED*ex1\ stopped\ answering*) ok record-failed-1 ;; *) fail record-failed-1 "$s" ;; esac
wait "$EXPID" 2>/dev/null
start_ex && ok executor-back || fail executor-back "$(tail -5 "$W/ex1.err")"
# Every process of the killed executor (its pre-started workers, the parent's VMM) ends: the
# workers on their own, the parent's VMM killed by the new executor (never made ready).
i=0; while [ $i -lt 60 ] && [ -n "$(alive "$ours")" ]; do sleep 0.5; i=$((i + 1)); done
left=$(alive "$ours")
[ -z "$left" ] && ok nothing-left-1 || fail nothing-left-1 "still running: $(for p in $left; do tr '\0' ' ' <"/proc/$p/cmdline"; echo; done)"
grep -q 'killing a VM that was never made ready' "$W/ex1.err" && ok parent-vmm-killed \
  || echo "(the parent's VMM had ended with its executor: nothing for the new one to kill)"
# The killed attempt's staging directory stays (hidden; swept after an hour), never a
# snapshot under the tag.
ls -a "$W/ex1/vms" "$SN"
if "$T" snapshots create --tag k1 --image "$IMG" --executor ex1 >"$W/retry-k1" 2>&1; then ok retry-1; else fail retry-1 "$(tail -5 "$W/retry-k1")"; fi
case "$(state_of k1)" in *FAILED*|*WRITING*) fail ready-1 "$(state_of k1)" ;; *) [ -e "$SN/k1/snapshot.json" ] && ok ready-1 || fail ready-1 "no $SN/k1" ;; esac
child_answers k1 && ok child-1 || fail child-1 "$(cat "$W/spawn-k1")"

# 2. The control plane is killed while the parent writes; the executor goes on alone.
"$T" snapshots create --tag k2 --image "$IMG" --executor ex1 >"$W/create-k2" 2>&1 &
CREATE=$!
if wait_writing 600 k2; then ok writing-2; else fail writing-2 "the parent never wrote: $(tail -5 "$W/create-k2")"; exit 1; fi
kill -9 "$CPPID"
wait "$CREATE"; rc=$?
[ $rc != 0 ] && ok create-2-fails || fail create-2-fails "create answered success though the control plane was killed"
wait "$CPPID" 2>/dev/null
# The executor finishes the snapshot nobody waits for any more (up to 5 minutes).
i=0; while [ $i -lt 300 ] && [ ! -e "$SN/k2/snapshot.json" ]; do sleep 1; i=$((i + 1)); done
ls -a "$SN"
CPSTART=$(date +%s)
start_cp
# The executor's row outlived the control plane; its heartbeats keep it up. Up on a
# heartbeat the new control plane received (SEEN, in whole seconds, younger than it: the
# old one was killed before), not on the row's last one before the kill, which may be about
# to age out.
heard_since_start() {
  "$T" executors ls 2>/dev/null | awk -v age=$(($(date +%s) - CPSTART)) \
    '$1 == "ex1" && $2 == "up" && $6 + 0 < age - 1 { f = 1 } END { exit !f }'
}
heard=""; i=0
while [ $i -lt 60 ]; do heard_since_start && { heard=1; break; }; sleep 0.5; i=$((i + 1)); done
[ -n "$heard" ] && ok executor-up-2 || fail executor-up-2 "$(($(date +%s) - CPSTART)) s after the start: $("$T" executors ls 2>&1)"
s=$(state_of k2); echo "after the control plane's kill: $s"
case "$s" in *FAILED*cut\ short*) ok record-failed-2 ;; *) fail record-failed-2 "$s" ;; esac
# The control plane's record is what counts: a copy it does not call ready is never spawned.
"$T" sandbox spawn --tag k2 -n 1 --ready-timeout-ms 60000 >"$W/spawn-failed" 2>&1 \
  && fail no-spawn-of-failed "$(cat "$W/spawn-failed")" || ok no-spawn-of-failed
if "$T" snapshots create --tag k2 --image "$IMG" --executor ex1 >"$W/retry-k2" 2>&1; then ok retry-2; else fail retry-2 "$(tail -5 "$W/retry-k2")"; fi
case "$(state_of k2)" in *FAILED*|*WRITING*) fail ready-2 "$(state_of k2)" ;; *) ok ready-2 ;; esac
child_answers k2 && ok child-2 || fail child-2 "$(cat "$W/spawn-k2")"
"$T" snapshots ls
