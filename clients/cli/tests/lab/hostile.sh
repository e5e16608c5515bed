# A compromised guest agent, sourced by up.sh once `tine up` runs and snapshot "py" exists. Its
# image carries the agent built with the `hostile` feature, which breaches the protocol on
# request (executor/agent/src/server/hostile.rs). Each breach must end its call with a clear
# error in bounded time, the executor's memory must stay flat, and a sibling must answer
# throughout. Uses T, W, UP, VENV, PY, ok and fail from up.sh.

hrss() { awk '/^VmRSS/ {print $2}' "/proc/$UP/status"; }
in_flight_refusal="calls to its guest agent in flight"

if ! "$T" snapshots create --tag hostile --image busybox-hostile >"$W/create-hostile" 2>&1; then
  fail hostile-garbage "no snapshot of the hostile image: $(tail -3 "$W/create-hostile")"
  return 0
fi
H=$("$T" sandbox spawn --tag hostile -n 1 2>&1 | grep 'ready in' | awk '{print $1}')
HSIB=$("$T" sandbox spawn --tag py -n 1 2>&1 | grep 'ready in' | awk '{print $1}')
echo "hostile child: $H, its sibling: $HSIB"
hrss0=$(hrss)

# A frame that is not protobuf, and a 4 GiB length prefix: refused at once.
out=$("$T" sandbox exec "$H" -- tine-hostile garbage 2>&1)
case $out in *"malformed protobuf frame"*) ok hostile-garbage ;; *) fail hostile-garbage "$out" ;; esac
out=$("$T" sandbox exec "$H" -- tine-hostile oversized 2>&1)
case $out in *"exceeds the 4194304 byte limit"*) ok hostile-oversized ;; *) fail hostile-oversized "$out" ;; esac

# A frame that stops after its first KiB, and an upload the guest never reads: each ends after
# the client's stall timeout (30 s), whatever the caller waits.
t0=$(date +%s)
"$T" sandbox exec "$H" -- tine-hostile stall >"$W/h-stall" 2>&1 &
HSTALL=$!
head -c 67108864 /dev/zero >"$W/h-64m"
# Not in the same instant as the stall: begun together, the upload has been seen to keep
# flowing for about 30 s before the guest stopped taking it (so failing at ~60 s, still
# bounded); here the point is each bound on its own.
sleep 3
"$T" sandbox cp "$W/h-64m" "$H:/tine-hostile/never-read" >"$W/h-never" 2>&1 &
HNEVER=$!
wait $HSTALL
wait $HNEVER
t1=$(date +%s)
echo "hostile: stall: $(tail -1 "$W/h-stall")"
echo "hostile: never-read upload: $(tail -1 "$W/h-never")"
echo "hostile: both ended after $((t1 - t0)) s"
grep -q "stalled for 30s in the middle of a 4194304-byte frame" "$W/h-stall" \
  && ok hostile-stall || fail hostile-stall "$(cat "$W/h-stall")"
grep -q "read nothing of this call's data for 30s" "$W/h-never" \
  && ok hostile-never-reads || fail hostile-never-reads "$(cat "$W/h-never")"

# 34 calls the guest never answers, from one Python client (threads, not 34 processes: L1 has
# one emulated CPU): 32 are held and 2 refused at once; a sibling answers meanwhile.
"$VENV/bin/python" - "$H" "$PY" >"$W/h-silent" 2>&1 <<'PYEOF' &
import sys, threading, time
sys.path.insert(0, sys.argv[2])
from tine import Client
from tine.errors import TineError
sb = Client().sandbox(sys.argv[1])
done = []
def call():
    try:
        sb.exec(["tine-hostile", "silent"])
        done.append("returned")
    except TineError as e:
        done.append(e.code)
for _ in range(34):
    threading.Thread(target=call, daemon=True).start()
deadline = time.time() + 120
while time.time() < deadline and len(done) < 2:
    time.sleep(0.2)
time.sleep(3)
print("ended:", " ".join(sorted(done)) or "none", flush=True)
time.sleep(3600)
PYEOF
HSILENT=$!
i=0
until grep -q '^ended:' "$W/h-silent" 2>/dev/null; do
  i=$((i + 1)); [ $i -lt 300 ] || break
  sleep 0.5
done
cat "$W/h-silent"
[ "$(grep '^ended:' "$W/h-silent")" = "ended: RESOURCE_EXHAUSTED RESOURCE_EXHAUSTED" ] \
  && ok hostile-cap || fail hostile-cap "$(cat "$W/h-silent")"
s0=$(date +%s%N)
v=$("$T" sandbox eval "$HSIB" 'parent_value * 2' 2>&1)
s1=$(date +%s%N)
echo "hostile: a sibling's eval with 32 calls held by a silent guest took $(( (s1 - s0) / 1000000 )) ms"
[ "$v" = 42 ] && ok hostile-sibling || fail hostile-sibling "answered '$v'"
hrss1=$(hrss)
echo "hostile: tine up RSS ${hrss0} kB before, ${hrss1} kB with 32 calls held"
[ $((hrss1 - hrss0)) -lt 65536 ] && ok hostile-memory || fail hostile-memory "RSS grew $((hrss1 - hrss0)) kB"

# The caller of the silent calls goes away: the executor cancels them, so the sandbox takes
# calls again (the refusal is gone) without anyone waiting on the guest.
before=$("$T" sandbox exec "$H" -- tine-hostile garbage 2>&1)
kill $HSILENT 2>/dev/null
wait $HSILENT 2>/dev/null
i=0
while :; do
  out=$("$T" sandbox exec "$H" -- tine-hostile garbage 2>&1)
  case $out in *"$in_flight_refusal"*) ;; *) break ;; esac
  i=$((i + 1)); [ $i -lt 40 ] || break
  sleep 0.5
done
case $before/$out in
  *"$in_flight_refusal"*/*"malformed protobuf frame"*) ok hostile-cancel ;;
  *) fail hostile-cancel "before: $before; after $i tries: $out" ;;
esac
"$T" sandbox kill "$H" "$HSIB" >/dev/null 2>&1
