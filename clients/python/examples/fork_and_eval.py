#!/usr/bin/env python3
"""Fork 3 sandboxes from a warm snapshot, run Python in each, kill them.

    TINE_ADDR=127.0.0.1:7070 TINE_TOKEN=... python3 examples/fork_and_eval.py [TAG] [-n N]

TAG defaults to "py" (make one with e.g. `tine snapshot --image python-numpy --tag py`).
"""

from __future__ import annotations

import argparse
import sys
import time

import tine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tag", nargs="?", default="py", help="snapshot to fork (default: py)")
    ap.add_argument("-n", type=int, default=3, help="how many children (default: 3)")
    args = ap.parse_args()

    client = tine.Client()
    t0 = time.perf_counter()
    try:
        sandboxes = client.spawn(args.tag, n=args.n)
    except tine.SpawnError as e:
        for f in e.failures:
            print(f"failed: {f}", file=sys.stderr)
        sandboxes = e.sandboxes  # the ones that did start: still use (and kill) them
    except tine.TineError as e:
        print(f"spawn failed: {e}", file=sys.stderr)
        return 1
    wall_ms = (time.perf_counter() - t0) * 1000
    print(f"{len(sandboxes)} of {args.n} children of {args.tag!r} ready in {wall_ms:.1f} ms (wall, client side)")

    try:
        for i, sb in enumerate(sandboxes):
            # Each child is its own fork of the parent: x set here is private to it.
            sb.eval(f"x = {i + 1}")
            value = sb.eval("x * 2")
            print(f"  {sb.id} on {sb.executor or '?'}: ready in {sb.ready_us / 1000:.2f} ms, x * 2 = {value}")
    except (tine.TineError, tine.EvalError) as e:
        print(f"eval failed: {e}", file=sys.stderr)
        return 1
    finally:
        for sb in sandboxes:
            try:
                sb.kill()
            except tine.TineError as e:
                print(f"kill {sb.id}: {e}", file=sys.stderr)
    return 0 if len(sandboxes) == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
