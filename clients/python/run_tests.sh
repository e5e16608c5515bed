#!/usr/bin/env bash
# Set up a venv, generate the stubs, install the client, type-check it, run its tests.
#
#   TINE_ADDR=127.0.0.1:7070 TINE_TOKEN=... [TINE_TEST_TAG=py] ./run_tests.sh
#   ./run_tests.sh --offline       # only the tests that need no server
#
# tests/test_offline.py always runs (configuration, a closed port, and every call against
# an in-process fake control plane). tests/test_client.py needs a live server named by
# TINE_ADDR (token: TINE_TOKEN, TINE_TOKEN_FILE or <data dir>/admin.token); without
# TINE_ADDR its tests are skipped, with a warning. TINE_TEST_TAG (a snapshot to fork)
# adds the spawn/eval/exec/files/kill tests.
#
# Environment: TINE_PY_VENV (default ~/.cache/tine/pyclient-venv), PYTHON (the
# interpreter that makes the venv, default python3, >= 3.11), TINE_PY_SKIP_MYPY=1.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$here"

offline=0
for arg in "$@"; do
  case $arg in
    --offline) offline=1 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "run_tests.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

venv=${TINE_PY_VENV:-${HOME:-/root}/.cache/tine/pyclient-venv}
base_py=${PYTHON:-python3}

step() { echo "== $*"; }

if [[ ! -x "$venv/bin/python" ]] || ! "$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  "$base_py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "run_tests.sh: $base_py is older than Python 3.11" >&2; exit 1; }
  step "creating venv $venv"
  rm -rf "$venv"
  "$base_py" -m venv "$venv"
fi
py=$venv/bin/python

step "installing dependencies (requirements-dev.txt)"
"$py" -m pip install -q --disable-pip-version-check -r requirements-dev.txt

step "generating stubs"
PYTHON=$py ./generate.sh

step "installing the tine package"
rm -rf build ./*.egg-info   # stale build/lib would leak removed modules into the wheel
"$py" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation --force-reinstall .
rm -rf build ./*.egg-info
(cd / && "$py" -c 'import tine, tine.v1.tine_pb2_grpc; print("   imported", tine.__file__)')

if [[ "${TINE_PY_SKIP_MYPY:-0}" != 1 ]]; then
  step "mypy --strict"
  "$venv/bin/mypy" --strict tine tests examples
fi

status=0
step "tests/test_offline.py"
"$py" tests/test_offline.py || status=1

if (( offline )); then
  step "skipping tests/test_client.py (--offline)"
else
  if [[ -z "${TINE_ADDR:-}" ]]; then
    echo "WARNING: TINE_ADDR is not set: the live-server tests will be skipped" >&2
  fi
  step "tests/test_client.py (live server: ${TINE_ADDR:-none})"
  "$py" tests/test_client.py || status=1
fi
exit $status
