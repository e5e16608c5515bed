#!/bin/sh
# Guest-agent acceptance scenario, run where Linux boots (a VMX/SVM host or the nested lab).
# Usage: agent.sh TINE IMAGE WORKDIR. Prints "CHECK <name> ok" or "CHECK <name> FAIL <why>".
set -u
T=$1 IMG=$2 W=$3
mkdir -p "$W"
S=$W/vm.sock
. "$(dirname "$0")/common.sh"
boot_and_wait_ready 300

out=$("$T" exec --socket "$S" -- uname -a)
case "$out" in Linux*) ok uname; echo "uname: $out" ;; *) fail uname "$out" ;; esac

"$T" exec --socket "$S" -- sh -c 'exit 3'
rc=$?; [ $rc = 3 ] && ok exit-code || fail exit-code "got $rc"

"$T" exec --socket "$S" -- sh -c 'for i in 0 1 2; do echo out$i; echo err$i >&2; done; head -c 10485760 /dev/zero' >"$W/o" 2>"$W/e"
osize=$(wc -c <"$W/o")
if [ "$(head -n 3 "$W/o")" = "$(printf 'out0\nout1\nout2')" ] && [ "$osize" = 10485775 ] &&
   [ "$(cat "$W/e")" = "$(printf 'err0\nerr1\nerr2')" ]; then ok streams-10mb
else fail streams-10mb "stdout $osize bytes, stderr: $(head -c 100 "$W/e")"; fi

head -c 52428800 /dev/urandom >"$W/f"
want=$(sha256sum "$W/f" | cut -d' ' -f1)
"$T" cp --socket "$S" "$W/f" vm:/tmp/f && "$T" cp --socket "$S" vm:/tmp/f "$W/f2"
got=$(sha256sum "$W/f2" 2>/dev/null | cut -d' ' -f1)
inguest=$("$T" exec --socket "$S" -- sha256sum /tmp/f | cut -d' ' -f1)
[ "$want" = "$got" ] && [ "$want" = "$inguest" ] && ok file-50mb || fail file-50mb "sent $want back $got guest $inguest"

"$T" exec --socket "$S" --timeout 2 -- sleep 60 2>"$W/t"
rc=$?; [ $rc = 124 ] && grep -q "timed out" "$W/t" && ok timeout || fail timeout "rc $rc: $(cat "$W/t")"

"$T" cp --socket "$S" "$W/f" vm:../../etc/evil 2>"$W/p"
rc=$?; [ $rc != 0 ] && grep -q '\.\.' "$W/p" && ok hostile-path || fail hostile-path "rc $rc: $(cat "$W/p")"

"$T" exec --socket "$S" -- poweroff -f >/dev/null 2>&1
wait $VM
rc=$?; [ $rc = 0 ] && ok poweroff || fail poweroff "VMM exit $rc"
