# Shared by the scenarios that boot one image and talk to its agent. Source it after setting
# T (tine), IMG, W (work dir) and S (vsock socket path).
ok() { echo "CHECK $1 ok"; }
fail() { echo "CHECK $1 FAIL $2"; }
console_tail() { tail -c 1500 "$W/console.log" | tr '\n' '|'; }

# Boot IMG in the background and wait up to $1 s for its agent, while the VM is alive; if the
# VMM exits first, say so at once.
boot_and_wait_ready() {
  "$T" run --image "$IMG" --vsock "$S" --console "$W/console.log" --quiet &
  VM=$!
  # Wall-clock bound (each ping may take up to its own --wait), so a failure is reported
  # before the lab's own limit kills everything.
  deadline=$(($(date +%s) + $1))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    if "$T" ping --socket "$S" --wait 5 >"$W/ping" 2>&1; then ok ready; return 0; fi
    if ! kill -0 "$VM" 2>/dev/null; then
      wait "$VM"; rc=$?
      fail ready "VM exited ($rc) before its agent was ready; console tail: $(console_tail)"
      exit 1
    fi
  done
  fail ready "not ready after $1 s: $(cat "$W/ping"); console tail: $(console_tail)"; exit 1
}
