# Child networks, sourced by up.sh once `tine up` runs (started with --net-no-masquerade, so
# each child's traffic arrives with its own link address) and snapshot "py" exists.
# A server in a namespace made here stands for the internet: nothing leaves the machine.
# Uses T, W, ok and fail from up.sh.

INET=tine-test-inet
cat >"$W/whoami.py" <<'PY'
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = self.client_address[0].encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer((sys.argv[1], int(sys.argv[2])), H).serve_forever()
PY
ip netns add $INET
ip link add inet-h type veth peer name inet-g netns $INET
ip addr add 198.51.100.1/24 dev inet-h && ip link set inet-h up
ip -n $INET addr add 198.51.100.2/24 dev inet-g
ip -n $INET link set inet-g up && ip -n $INET link set lo up
ip -n $INET route add 10.200.0.0/16 via 198.51.100.1
ip netns exec $INET python3 "$W/whoami.py" 198.51.100.2 8080 & S1=$!
ip netns exec $INET python3 "$W/whoami.py" 198.51.100.2 8081 & S2=$!
# A service on the executor host itself, on every address: no child may reach it.
python3 "$W/whoami.py" 0.0.0.0 9999 & S3=$!
i=0
until ip netns exec $INET python3 -c 'import socket; [socket.create_connection(("198.51.100.2", p), 1) for p in (8080, 8081)]' 2>/dev/null \
    && python3 -c 'import socket; socket.create_connection(("127.0.0.1", 9999), 1)' 2>/dev/null; do
  i=$((i + 1)); [ $i -lt 60 ] || { fail net-servers "the test servers never listened"; break; }
  sleep 0.5
done

# get ID URL: the status and body a child gets for URL, or its error.
get() {
  "$T" sandbox exec "$1" -- python3 -c 'import sys, urllib.request
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=8)
    print(r.status, r.read().decode())
except Exception as e:
    print("ERR", e)' "$2" 2>&1
}
spawn_net() { # NAME ARGS...: spawn one child, print its id
  name=$1; shift
  "$T" sandbox spawn --tag py -n 1 "$@" >"$W/spawn-$name" 2>&1
  grep 'ready in' "$W/spawn-$name" | awk '{print $1}'
}
ns_of() { python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["net"])' "$W/data/vms/$1/meta.json"; }
link_of() { ip -n "$(ns_of "$1")" -4 -o addr show veth0 | awk '{print $4}' | cut -d/ -f1; }
host_end() { link_of "$1" | awk -F. '{print $1"."$2"."$3"."$4-1}'; }
refused() { case $1 in ERR*) return 0 ;; *) return 1 ;; esac; }

# The acceptance command, as a user types it.
A=$(spawn_net a)
out=$("$T" sandbox exec "$A" -- python3 -c 'import urllib.request; print(urllib.request.urlopen("http://198.51.100.2:8080/").status)' 2>&1)
echo "internet allowed: $out"
[ "$out" = 200 ] && ok net-internet || fail net-internet "$out"

# Two children of one snapshot (same guest address and MAC) reach the server at the same
# time, and it tells them apart.
B=$(spawn_net b)
get "$A" http://198.51.100.2:8080/ >"$W/get-a" & P1=$!
get "$B" http://198.51.100.2:8080/ >"$W/get-b" & P2=$!
wait $P1 $P2
ra=$(cat "$W/get-a") rb=$(cat "$W/get-b")
echo "the server saw: $ra / $rb (links $(link_of "$A") / $(link_of "$B"))"
case "$ra|$rb" in
  "200 10.200."*"|200 10.200."*) [ "$ra" != "$rb" ] && ok net-two-children || fail net-two-children "same address: $ra" ;;
  *) fail net-two-children "$ra / $rb" ;;
esac

# Denied: a clear, immediate failure.
D=$(spawn_net deny --internet deny)
out=$(get "$D" http://198.51.100.2:8080/)
echo "internet denied: $out"
refused "$out" && ok net-denied || fail net-denied "$out"

# Allow-list by address and port with the internet denied; a deny entry beats the default.
L=$(spawn_net allow --internet deny --allow 198.51.100.2:8080)
o1=$(get "$L" http://198.51.100.2:8080/) o2=$(get "$L" http://198.51.100.2:8081/)
echo "allow-list: 8080 -> $o1; 8081 -> $o2"
case $o1 in 200*) refused "$o2" && ok net-allow-list || fail net-allow-list "8081: $o2" ;; *) fail net-allow-list "8080: $o1" ;; esac
N=$(spawn_net denylist --deny 198.51.100.0/24)
out=$(get "$N" http://198.51.100.2:8080/)
refused "$out" && ok net-deny-list || fail net-deny-list "$out"

# Never the executor host: not its address on the "internet" link, not its end of the child's
# own link (the service answers the "internet" side, so it is up).
o1=$(get "$A" http://198.51.100.1:9999/) o2=$(get "$A" "http://$(host_end "$A"):9999/")
o3=$(ip netns exec $INET python3 -c 'import urllib.request; print(urllib.request.urlopen("http://198.51.100.1:9999/", timeout=5).status)' 2>&1)
echo "host service: from a child $o1 / $o2; from the internet side $o3"
refused "$o1" && refused "$o2" && [ "$o3" = 200 ] && ok net-no-host || fail net-no-host "$o1 / $o2 / $o3"

# Never another child: B serves HTTP; the host reaches it on B's link address, A cannot.
"$T" sandbox eval "$B" 'import threading, http.server; srv = http.server.ThreadingHTTPServer(("0.0.0.0", 8000), http.server.SimpleHTTPRequestHandler); threading.Thread(target=srv.serve_forever, daemon=True).start(); "serving"' >/dev/null 2>&1
BL=$(link_of "$B")
o1=$(python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=8).status)' "http://$BL:8000/" 2>&1)
o2=$(get "$A" "http://$BL:8000/")
echo "child B's server: from the host $o1; from child A $o2"
[ "$o1" = 200 ] && refused "$o2" && ok net-no-siblings || fail net-no-siblings "host $o1, sibling $o2"

# An exposed port: B's server on an address of the executor host.
EXPOSED=$("$T" sandbox port "$B" 8000 2>&1)
o1=$(python3 -c 'import sys, urllib.request; print(urllib.request.urlopen("http://" + sys.argv[1] + "/", timeout=8).status)' "$EXPOSED" 2>&1)
echo "B's port 8000 exposed on $EXPOSED: $o1"
[ "$o1" = 200 ] && ok net-exposed-port || fail net-exposed-port "$EXPOSED: $o1"

# Killed children take their namespaces and exposed ports with them.
gone=0 all=0
for id in $A $B $D $L $N; do
  ns=$(ns_of "$id"); all=$((all + 1))
  "$T" sandbox kill "$id" >/dev/null 2>&1
  i=0; while [ $i -lt 20 ] && [ -e "/run/netns/$ns" ]; do sleep 0.5; i=$((i + 1)); done
  [ -e "/run/netns/$ns" ] || gone=$((gone + 1))
done
closed=$(python3 -c 'import socket, sys; h, p = sys.argv[1].rsplit(":", 1)
try:
    socket.create_connection((h, int(p)), 3); print("open")
except OSError as e:
    print("closed:", e)' "$EXPOSED" 2>&1)
case $closed in
  closed*) [ "$gone" = "$all" ] && ok net-cleanup || fail net-cleanup "$gone of $all namespaces removed" ;;
  *) fail net-cleanup "the exposed port outlived its sandbox: $closed" ;;
esac
kill $S1 $S2 $S3 2>/dev/null
ip netns del $INET; ip link del inet-h 2>/dev/null
