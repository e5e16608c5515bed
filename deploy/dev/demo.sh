#!/usr/bin/env bash
# Set up a fresh host and run the main job: boot the Debian cloud kernel in Tine's own VMM
# with 2 vCPUs to a userspace /init that prints a marker and powers off. On a host whose
# /dev/kvm cannot boot Linux (no VMX/SVM, e.g. PVM), it runs inside the nested lab.
set -euo pipefail
cd "$(dirname "$0")/../.."

bash deploy/dev/setup.sh
cargo build --release -p tine-cli
TINE="$PWD/target/release/tine"
"$TINE" image kernel --flavor cloud >/dev/null
"$TINE" doctor || true
if [ -e /sys/module/kvm_pvm ] || ! grep -qwE 'vmx|svm' /proc/cpuinfo; then
  echo "demo: no VMX/SVM here: booting inside the nested lab"
  exec "$TINE" lab -- "$TINE" run --vcpus 2
fi
exec "$TINE" run --vcpus 2
