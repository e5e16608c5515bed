#!/usr/bin/env bash
# Generate the Python gRPC stubs (and mypy .pyi stubs) for proto/tine/**/*.proto.
#
# The proto package is `tine.v1`, so the generated modules import each other as
# `tine.v1.tine_pb2`. We give them exactly that place: they are written into this
# client's own `tine` package (tine/v1/...), so the imports resolve as they are, with
# no rewriting of generated code and no sys.path tricks. Generated directories carry a
# `_GENERATED` marker and are git-ignored; this script only ever replaces directories
# that carry the marker (or do not exist yet).
#
# Usage: ./generate.sh            (uses $PYTHON, default: python3, which must have
#                                  grpcio-tools and mypy-protobuf installed)
#        TINE_PROTO_DIR=/path ./generate.sh
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
proto_dir=$(cd "${TINE_PROTO_DIR:-$here/../../proto}" && pwd)
py=${PYTHON:-python3}

die() { echo "generate.sh: $*" >&2; exit 1; }

"$py" -c 'import grpc_tools.protoc' 2>/dev/null \
  || die "$py has no grpc_tools (pip install grpcio-tools; see requirements-dev.txt)"

# protoc plugins from mypy-protobuf: next to the interpreter (venv/bin) or on PATH.
bindir=$("$py" -c 'import os, sys; print(os.path.dirname(sys.executable))')
plugin() {
  if [[ -x "$bindir/$1" ]]; then echo "$bindir/$1"
  elif command -v "$1" >/dev/null; then command -v "$1"
  else die "$1 not found next to $py nor on PATH (pip install mypy-protobuf)"
  fi
}
mypy_plugin=$(plugin protoc-gen-mypy)
mypy_grpc_plugin=$(plugin protoc-gen-mypy_grpc)

# The public API (tine/v1/*.proto) plus whatever it imports, transitively (the
# well-known google/protobuf types come with the protobuf runtime). The internal
# protos (agent, executor, store) are not part of the client.
mapfile -t queue < <(cd "$proto_dir" && find tine/v1 -maxdepth 1 -name '*.proto' | LC_ALL=C sort)
(( ${#queue[@]} > 0 )) || die "no .proto files under $proto_dir/tine/v1"
declare -A seen=()
protos=()
while (( ${#queue[@]} > 0 )); do
  f=${queue[0]}; queue=("${queue[@]:1}")
  [[ -n "${seen[$f]:-}" ]] && continue
  seen[$f]=1
  [[ -f "$proto_dir/$f" ]] || die "$f (imported) not found under $proto_dir"
  protos+=("$f")
  while IFS= read -r dep; do
    [[ "$dep" == google/protobuf/* ]] || queue+=("$dep")
  done < <(sed -n 's/^[[:space:]]*import[[:space:]]\{1,\}\(public[[:space:]]\{1,\}\|weak[[:space:]]\{1,\}\)\{0,1\}"\([^"]*\)".*/\2/p' "$proto_dir/$f")
done
mapfile -t protos < <(printf '%s\n' "${protos[@]}" | LC_ALL=C sort)
for f in "${protos[@]}"; do
  [[ "$f" == tine/* ]] || die "$f is outside tine/: it would land outside the package"
done

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

(cd "$proto_dir" && "$py" -m grpc_tools.protoc \
  -I . \
  --plugin=protoc-gen-mypy="$mypy_plugin" \
  --plugin=protoc-gen-mypy_grpc="$mypy_grpc_plugin" \
  --python_out="$tmp" \
  --grpc_python_out="$tmp" \
  --mypy_out=quiet:"$tmp" \
  --mypy_grpc_out=quiet:"$tmp" \
  "${protos[@]}")

[[ -d "$tmp/tine" ]] || die "protoc wrote nothing under tine/"

# Every generated directory becomes a regular package (setuptools finds it, mypy too).
while IFS= read -r d; do
  [[ -e "$d/__init__.py" ]] || : > "$d/__init__.py"
  echo "generated from $proto_dir by generate.sh; do not edit, do not commit" > "$d/_GENERATED"
done < <(find "$tmp/tine" -mindepth 1 -type d)

# Drop generated directories that this run no longer produces (stale stubs).
for old in "$here"/tine/*/; do
  name=$(basename "$old")
  if [[ -e "$old/_GENERATED" && ! -d "$tmp/tine/$name" ]]; then rm -rf "$old"; fi
done

# Swap each top-level generated directory (tine/v1, ...) into place.
for src in "$tmp"/tine/*/; do
  name=$(basename "$src")
  dst="$here/tine/$name"
  if [[ -e "$dst" && ! -e "$dst/_GENERATED" ]]; then
    die "refusing to replace $dst: it has no _GENERATED marker (hand-written?)"
  fi
  rm -rf "$dst.new"
  cp -r "$src" "$dst.new"
  rm -rf "$dst"
  mv "$dst.new" "$dst"
done
if compgen -G "$tmp/tine/*.py" >/dev/null; then
  die "a .proto directly under proto/tine/ would clash with the hand-written package"
fi

# The generated modules must import as they are, from this directory.
(cd "$here" && "$py" -c 'import tine.v1.tine_pb2, tine.v1.tine_pb2_grpc') \
  || die "generated stubs do not import"
echo "generate.sh: $(cd "$here" && find tine -name _GENERATED -printf '%h\n' | LC_ALL=C sort | tr '\n' ' ')<- ${protos[*]}"
