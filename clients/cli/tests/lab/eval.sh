#!/bin/sh
# Warm-eval scenario on the python-numpy image. Usage: eval.sh TINE IMAGE WORKDIR.
set -u
T=$1 IMG=$2 W=$3
mkdir -p "$W"
S=$W/vm.sock
. "$(dirname "$0")/common.sh"
boot_and_wait_ready 400

out=$("$T" eval --socket "$S" 'numpy.zeros(5).tolist()' 2>&1)
[ "$out" = "[0.0, 0.0, 0.0, 0.0, 0.0]" ] && ok numpy-zeros || fail numpy-zeros "$out"

out=$("$T" eval --socket "$S" '1/0' 2>&1)
rc=$?
case "$out" in *Traceback*ZeroDivisionError*) [ $rc = 1 ] && ok exception || fail exception "rc $rc" ;;
  *) fail exception "$out" ;; esac

"$T" eval --socket "$S" 'x = 41' >/dev/null 2>&1
out=$("$T" eval --socket "$S" 'x + 1' 2>&1)
[ "$out" = "42" ] && ok usable-after-exception || fail usable-after-exception "$out"

# Latency: exec round trip and warm eval, beside a cold interpreter, all in this run.
"$T" bench agent --socket "$S" --iterations 30 && ok bench || fail bench "agent bench failed"

# Power off through the agent; the VMM must exit. If it does not, ask it for its vsock state
# (SIGUSR1) before killing it, so a stall is diagnosable from this log.
"$T" exec --socket "$S" -- poweroff -f >"$W/poweroff.out" 2>&1 &
i=0
while kill -0 "$VM" 2>/dev/null && [ $i -lt 60 ]; do sleep 1; i=$((i + 1)); done
if kill -0 "$VM" 2>/dev/null; then
  kill -USR1 "$VM"; sleep 2
  fail poweroff "the VM still ran 60 s after poweroff; exec said: $(cat "$W/poweroff.out"); console tail: $(console_tail)"
  kill "$VM"
else
  wait "$VM" && ok poweroff || fail poweroff "VMM exit status $?"
fi
