#!/usr/bin/env bash
# Set up a fresh host and run the main job on the embedded default: `tine up` (control plane +
# local executor in one process), a warm python-numpy parent snapshotted through the gRPC API,
# ten copy-on-write children forked from it, Python evaluated in each. On a host whose /dev/kvm
# cannot boot Linux (no VMX/SVM, e.g. PVM), it runs inside the nested lab.
set -euo pipefail
cd "$(dirname "$0")/../.."

bash deploy/dev/setup.sh
bash deploy/build.sh   # tine and, beside it, the static tine-agent that tine image build uses
TINE="$PWD/target/dist/tine"
"$TINE" doctor || true
"$TINE" image build python-numpy
if [ -e /sys/module/kvm_pvm ] || ! grep -qwE 'vmx|svm' /proc/cpuinfo; then
  echo "demo: no VMX/SVM here: running inside the nested lab"
  exec "$TINE" lab --mem-mib 4096 --timeout 1200 -- sh "$PWD/deploy/dev/demo-embedded.sh" "$TINE" 10
fi
exec sh deploy/dev/demo-embedded.sh "$TINE" 10
