# Children's cgroups and lifetimes, sourced by up.sh once `tine up` runs and snapshot "py" exists. L1 mounts
# cgroup v2 with every controller, so the executor gives each child its own cgroup.
# Uses T, W, ok and fail from up.sh.

json_field() { python3 -c 'import json,sys; v=json.loads(sys.stdin.read())
for k in sys.argv[1].split("."): v = (v or {}).get(k)
print("" if v is None else v)' "$1"; }

# Below the floor: refused before any child starts, naming the field.
out=$("$T" sandbox spawn --tag py -n 1 --memory-limit-mib 16 2>&1)
case $out in
  *INVALID_ARGUMENT*memory_limit_mib*) ok limits-floor ;;
  *) fail limits-floor "$out" ;;
esac

# The acceptance command: two children held to 128 MiB and a quarter of a core.
"$T" sandbox spawn --tag py -n 2 --memory-limit-mib 128 --cpu-millis 250 >"$W/spawn-lim" 2>&1
cat "$W/spawn-lim"
L1=$(grep 'ready in' "$W/spawn-lim" | awk 'NR == 1 {print $1}')
L2=$(grep 'ready in' "$W/spawn-lim" | awk 'NR == 2 {print $1}')
"$T" sandbox get "$L1" | tee "$W/get-lim"
# Where the executor put it: under the subtree of `tine up`'s own cgroup, or tine-<hash>; named
# as its record says (the cgroup its VMM worker waited in), or by its id.
cgn=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1])).get("cgroup") or sys.argv[2])' "$W/data/vms/$L1/meta.json" "$L1" 2>/dev/null)
cg=$(ls -d /sys/fs/cgroup/tine-*/vms/"$cgn" "/sys/fs/cgroup$(sed -n 's/^0:://p' "/proc/$UP/cgroup" | sed 's#/executor$##')/vms/$cgn" 2>/dev/null | head -1)
if [ -n "$cg" ] && [ "$(cat "$cg/memory.max")" = $((128 << 20)) ] \
   && [ "$(cat "$cg/cpu.max")" = "25000 100000" ] && [ "$(cat "$cg/memory.swap.max" 2>/dev/null || echo 0)" = 0 ] \
   && grep -q '^memory.current:' "$W/get-lim" && grep -q '^memory limit: *128 MiB' "$W/get-lim"; then
  ok limits-cgroup
else
  fail limits-cgroup "cgroup '$cg': $(cat "$cg/memory.max" "$cg/cpu.max" 2>&1 | tr '\n' ' ') $(cat "$W/get-lim")"
fi

# A busy loop for 4 s of the guest's (wall) time is held to its quarter of a core.
cpu0=$("$T" sandbox get "$L1" --json | json_field usage.cpu_usage_us)
thr0=$("$T" sandbox get "$L1" --json | json_field usage.cpu_throttled_periods)
t0=$(date +%s%N)
"$T" sandbox exec "$L1" -- python3 -c 'import time
t = time.time()
while time.time() - t < 4: pass' >/dev/null 2>&1
t1=$(date +%s%N)
cpu1=$("$T" sandbox get "$L1" --json | json_field usage.cpu_usage_us)
thr1=$("$T" sandbox get "$L1" --json | json_field usage.cpu_throttled_periods)
share=$(python3 -c "print(f'{($cpu1 - $cpu0) / (($t1 - $t0) / 1000):.3f}')")
echo "cpu-share: a busy guest at --cpu-millis 250 used $share of a core over $(( (t1 - t0) / 1000000 )) ms (throttled $((thr1 - thr0)) periods)"
if python3 -c "import sys; sys.exit(0 if $share < 0.4 else 1)" && [ $((thr1 - thr0)) -gt 0 ]; then
  ok limits-cpu-share
else
  fail limits-cpu-share "share $share, throttled $((thr1 - thr0)) periods"
fi

# A guest that writes past its limit: its VMM is killed, the sandbox FAILED with the reason,
# its sibling untouched.
"$T" sandbox eval "$L1" 'x = b"x" * (300 << 20); len(x)' >"$W/oom-eval" 2>&1
echo "the eval past the limit answered: $(tail -1 "$W/oom-eval")"
i=0
until "$T" sandbox get "$L1" --json >"$W/get-oom" 2>&1 \
    && [ "$(json_field state <"$W/get-oom")" = failed ]; do
  i=$((i + 1)); [ $i -lt 60 ] || break
  sleep 0.5
done
"$T" sandbox get "$L1"
err=$(json_field error <"$W/get-oom")
if [ "$(json_field state <"$W/get-oom")" = failed ] && case $err in "out of memory"*) true ;; *) false ;; esac \
   && [ -n "$cg" ] && [ ! -d "$cg" ] \
   && [ "$("$T" sandbox eval "$L2" 'parent_value * 2' 2>&1)" = 42 ]; then
  ok limits-oom
else
  fail limits-oom "$(cat "$W/get-oom"); cgroup left: $(ls -d "$cg" 2>&1)"
fi
if grep '"rpc":"SandboxEnded"' "$W/data/audit.log" | grep -q '"out_of_memory":true'; then
  ok limits-oom-audited
else
  fail limits-oom-audited "$(grep SandboxEnded "$W/data/audit.log")"
fi
# A guest flooding its output at a client that never reads: the executor holds a bounded
# buffer, so its memory stays flat, and a sibling answers meanwhile.
SIB=$("$T" sandbox spawn --tag py -n 1 2>&1 | grep 'ready in' | awk '{print $1}')
rss() { awk '/^VmRSS/ {print $2}' "/proc/$UP/status"; }
rss0=$(rss)
( "$T" sandbox exec "$L2" --timeout-ms 20000 -- sh -c 'yes flood-flood-flood' | sleep 25 ) >/dev/null 2>&1 &
FLOOD=$!
sleep 8
t0=$(date +%s%N)
v=$("$T" sandbox eval "$SIB" 'parent_value * 2' 2>&1)
t1=$(date +%s%N)
# Still flooding (blocked on the full stream, not finished): `yes` runs in the guest.
running=$("$T" sandbox exec "$L2" -- sh -c 'grep -lx yes /proc/[0-9]*/comm 2>/dev/null | wc -l' 2>&1)
sleep 4
rss1=$(rss)
echo "flood: tine up RSS ${rss0} kB before, ${rss1} kB after 12 s of a never-read flood (yes processes in the guest: $running); a sibling's eval took $(( (t1 - t0) / 1000000 )) ms"
if [ "$v" = 42 ] && [ "${running:-0}" -ge 1 ] 2>/dev/null && [ $((rss1 - rss0)) -lt 65536 ]; then ok hostile-flood
else fail hostile-flood "sibling answered '$v'; yes running: $running; RSS grew $((rss1 - rss0)) kB"; fi
"$T" sandbox kill "$L2" "$SIB" >/dev/null 2>&1
wait $FLOOD 2>/dev/null

# Lifetimes: a child given an hour, then three seconds from now, is killed by the control
# plane on time, its VM gone on the executor, and says why.
E=$("$T" sandbox spawn --tag py -n 1 --sandbox-timeout-secs 3600 2>&1 | grep 'ready in' | awk '{print $1}')
"$T" sandbox set-timeout "$E" 3
i=0
until [ "$("$T" sandbox get "$E" --json 2>/dev/null | json_field state)" = killed ]; do
  i=$((i + 1)); [ $i -lt 60 ] || break
  sleep 0.5
done
"$T" sandbox get "$E" --json >"$W/get-expired" 2>&1
case $(json_field error <"$W/get-expired") in
  "expired: its timeout ran out"*)
    if [ ! -e "$W/data/vms/$E" ]; then ok lifetime-expired
    else fail lifetime-expired "its VM is still on the executor"; fi ;;
  *) fail lifetime-expired "$(cat "$W/get-expired")" ;;
esac
