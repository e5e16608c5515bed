#!/bin/sh
# Snapshot-and-fork scenario on the python-numpy image.
# Usage: fork.sh TINE IMAGE WORKDIR [N_BIG [PARALLEL]]   (PARALLEL: most children restoring at once, 0 = all)
set -u
T=$1 IMG=$2 W=$3 BIG=${4:-20} PAR=${5:-0}
mkdir -p "$W"
export TINE_DATA_DIR=$W/data
ok() { echo "CHECK $1 ok"; }
fail() { echo "CHECK $1 FAIL $2"; }
sock() { echo "$TINE_DATA_DIR/vms/$1/vsock.sock"; }
# The Generic Event Device's interrupts a guest took (its "ACPI:Ged" line in /proc/interrupts,
# summed over CPUs), or "none" without such a line.
ged_irqs() {
  "$T" exec --socket "$(sock "$1")" -- cat /proc/interrupts 2>&1 |
    awk '/ACPI:Ged/ {s = 0; for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) s += $i; n = s} END {print (n == "" ? "none" : n)}'
}

if "$T" snapshot --image "$IMG" --tag warm --eval 'parent_value = 12345' 2>"$W/snap.err"; then ok snapshot
else fail snapshot "$(tail -5 "$W/snap.err")"; fi
cat "$W/snap.err"
# The cloud kernel has no generation-ID driver: the snapshot records that none bound, so its
# children are restored without the GED's interrupt (docs/vmm.md).
hdr=$(find "$TINE_DATA_DIR" -name snapshot.json | head -1)
grep -q '"vmgenid_driver": false' "$hdr" 2>/dev/null && ok vmgenid-driver-not-bound ||
  fail vmgenid-driver-not-bound "${hdr:-no snapshot.json}: $(grep vmgenid "$hdr" 2>/dev/null | tr -d '\n')"

"$T" fork --tag warm -n 10 --ready-timeout-secs 120 >"$W/fork10" 2>&1
cat "$W/fork10"
n=$(grep -c 'ready in' "$W/fork10")
[ "$n" = 10 ] && ok fork-10 || fail fork-10 "$n of 10 ready"
ids=$(grep 'ready in' "$W/fork10" | awk '{print $1}')
c1=$(echo "$ids" | sed -n 1p) c2=$(echo "$ids" | sed -n 2p)

good=0
for id in $ids; do
  v=$("$T" eval --socket "$(sock "$id")" 'parent_value' 2>&1)
  w=$("$T" eval --socket "$(sock "$id")" "__import__('sys').modules.get('numpy') is not None and numpy.zeros(2).tolist() == [0.0, 0.0]" 2>&1)
  [ "$v" = 12345 ] && [ "$w" = True ] && good=$((good + 1))
done
[ "$good" = 10 ] && ok parent-state-in-every-child || fail parent-state-in-every-child "$good of 10"

# No driver bound, so no child was sent the generation ID's interrupt.
g=$(ged_irqs "$c2")
[ "$g" = 0 ] && ok no-ged-interrupt || fail no-ged-interrupt "child $c2 took $g GED interrupts"

"$T" exec --socket "$(sock "$c1")" -- sh -c 'echo mine > /tmp/only-in-child1' >/dev/null
"$T" eval --socket "$(sock "$c1")" 'secret = 1' >/dev/null
"$T" exec --socket "$(sock "$c2")" -- test -e /tmp/only-in-child1; f=$?
s=$("$T" eval --socket "$(sock "$c2")" "'secret' in globals()")
"$T" exec --socket "$(sock "$c1")" -- test -e /tmp/only-in-child1; f1=$?
[ $f != 0 ] && [ $f1 = 0 ] && [ "$s" = False ] && ok divergence || fail divergence "file in child2: $f, secret in child2: $s"

ms=$("$T" exec --socket "$(sock "$c1")" -- sh -c 'a=$(date +%s%N); sleep 1; b=$(date +%s%N); echo $(( (b - a) / 1000000 ))')
[ "$ms" -ge 900 ] 2>/dev/null && [ "$ms" -le 3000 ] && ok sleep-1s || fail sleep-1s "sleep 1 took $ms ms"
echo "sleep 1 in a child took $ms ms"

g=$("$T" exec --socket "$(sock "$c1")" -- date +%s); h=$(date +%s)
d=$((g - h)); [ ${d#-} -le 5 ] && ok wall-clock || fail wall-clock "guest $g host $h"

r1=$("$T" exec --socket "$(sock "$c1")" -- sh -c 'head -c 16 /dev/urandom | od -An -tx1')
r2=$("$T" exec --socket "$(sock "$c2")" -- sh -c 'head -c 16 /dev/urandom | od -An -tx1')
[ -n "$r1" ] && [ "$r1" != "$r2" ] && ok urandom-differs || fail urandom-differs "$r1 / $r2"
p1=$("$T" eval --socket "$(sock "$c1")" 'import random; random.random()')
p2=$("$T" eval --socket "$(sock "$c2")" 'import random; random.random()')
[ -n "$p1" ] && [ "$p1" != "$p2" ] && ok python-random-differs || fail python-random-differs "$p1 / $p2"

# Every clone its own: Python's random, numpy's legacy and default_rng generators, uuid4, its
# hostname (its id) and machine-id, across all ten children.
: >"$W/identity"
for id in $ids; do
  printf '%s ' "$id" >>"$W/identity"
  "$T" eval --socket "$(sock "$id")" "import random, uuid, socket, numpy; ' '.join(map(str, (random.random(), numpy.random.rand(), numpy.random.default_rng().random(), uuid.uuid4(), socket.gethostname(), open('/etc/machine-id').read().strip())))" >>"$W/identity" 2>&1
done
cat "$W/identity"
if python3 - "$W/identity" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
assert len(rows) == 10 and all(len(r) == 7 for r in rows), rows
for i, name in enumerate(["random", "numpy legacy", "default_rng", "uuid4", "hostname", "machine-id"], 1):
    vals = [r[i].strip("'") for r in rows]
    assert len(set(vals)) == len(vals), f"{name} repeats: {vals}"
assert all(r[5].strip("'") == r[0] for r in rows), "hostname is not the sandbox id"
PY
then ok identity-distinct; else fail identity-distinct "see the table above"; fi

"$T" fork --tag warm -n 1 --ready-timeout-secs 120 >"$W/fork1" 2>&1
c3=$(grep 'ready in' "$W/fork1" | awk '{print $1}')
[ -n "$c3" ] && [ "$("$T" eval --socket "$(sock "$c3")" "'secret' in globals()")" = False ] &&
  ! "$T" exec --socket "$(sock "$c3")" -- test -e /tmp/only-in-child1 && ok new-child-clean || fail new-child-clean "$c3"
"$T" kill --all

# From a copy of the snapshot's memory held in huge pages, as an executor restores a hot one.
"$T" fork --tag warm -n "$BIG" --parallel "$PAR" --hold-image --ready-timeout-secs 300 >"$W/forkbig" 2>&1
tail -1 "$W/forkbig"
n=$(grep -c 'ready in' "$W/forkbig")
[ "$n" = "$BIG" ] && ok "fork-$BIG" || fail "fork-$BIG" "$n of $BIG ready: $(grep FAILED "$W/forkbig" | head -3)"
# Each worker's main thread says where its CPU went, step by step (docs/performance.md).
ids=$(grep 'ready in' "$W/forkbig" | awk '{print $1}')
m=0
for id in $ids; do
  grep -q 'main thread CPU ms: main .*, restore .*, start [0-9]' "$TINE_DATA_DIR/vms/$id/vmm.log" && m=$((m + 1))
done
[ "$m" = "$BIG" ] && ok cpu-marks || fail cpu-marks "$m of $BIG vmm.logs carry the marks"
for id in $(echo "$ids" | head -3); do
  grep 'main thread CPU' "$TINE_DATA_DIR/vms/$id/vmm.log"
done
"$T" ls | tail -2
"$T" kill --all

if "$T" bench fork --tag warm --image "$IMG" --counts "1,$BIG" --parallel "$PAR" --cold-runs 1; then ok bench; else fail bench "bench failed"; fi
