"""A tiny runner so the test files work both as plain scripts and under pytest.

Tests are module-level ``test_*`` functions; a test skips by raising
``unittest.SkipTest`` (which pytest also understands).
"""

from __future__ import annotations

import sys
import time
import traceback
import unittest
from collections.abc import Callable
from typing import Any


def run(module_name: str, namespace: dict[str, Any]) -> int:
    tests: list[tuple[str, Callable[[], object]]] = [
        (name, fn) for name, fn in namespace.items() if name.startswith("test_") and callable(fn)
    ]
    passed = failed = skipped = 0
    for name, fn in tests:
        t0 = time.monotonic()
        try:
            fn()
        except unittest.SkipTest as e:
            skipped += 1
            print(f"SKIP {name}: {e}", flush=True)
            continue
        except Exception:
            failed += 1
            print(f"FAIL {name}", flush=True)
            traceback.print_exc()
            continue
        passed += 1
        print(f"ok   {name} ({time.monotonic() - t0:.2f}s)", flush=True)
    print(f"{module_name}: {passed} passed, {failed} failed, {skipped} skipped", flush=True)
    return 1 if failed else 0


def main(module_name: str, namespace: dict[str, Any]) -> None:
    sys.exit(run(module_name, namespace))
