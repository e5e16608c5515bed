#!/usr/bin/env python3
"""Branch a sandbox mid-run and let its children diverge.

    TINE_ADDR=127.0.0.1:7070 TINE_TOKEN=... python3 examples/branch_and_diverge.py [TAG]

A sandbox forked from TAG (default "py") builds up state step by step. It is branched
mid-run: the branch is a snapshot of that instant, and the sandbox runs on. Three children
of the branch get different inputs; each keeps the state built before the branch and none
sees what the others (or the source, after the branch) did. A branch of one of them goes one
level deeper. Exits non-zero if any child saw the wrong state.
"""

from __future__ import annotations

import argparse
import secrets
import sys

import tine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tag", nargs="?", default="py", help="snapshot to fork (default: py)")
    args = ap.parse_args()
    client = tine.Client()
    suffix = secrets.token_hex(3)
    branch_tag, deeper_tag = f"{args.tag}-branch-{suffix}", f"{args.tag}-deeper-{suffix}"
    live: list[tine.Sandbox] = []
    ok = True
    try:
        (source,) = client.spawn(args.tag, n=1)
        live.append(source)
        source.eval("steps = []")
        for step in range(3):
            source.eval(f"steps.append({step} ** 2)")
        print(f"source {source.id}: steps = {source.eval('steps')}")

        snap = source.branch(branch_tag)
        b = snap.branch
        assert b is not None
        print(
            f"branched {source.id} as {snap.tag} (parent {snap.parent_tag}, {b.mode}): "
            f"paused {b.pause_us / 1000:.2f} ms, {b.pages_written} pages written since its fork or last branch"
        )
        source.eval("steps.append('source, after the branch')")
        print(f"source {source.id} runs on: steps = {source.eval('steps')}")

        children = client.spawn(branch_tag, n=3)
        live.extend(children)
        for i, child in enumerate(children):
            got = child.eval(f"steps.append({(i + 1) * 100}); steps")
            want = str([0, 1, 4, (i + 1) * 100])
            good = got == want
            ok &= good
            print(f"  child {i} {child.id}: ready in {child.ready_us / 1000:.1f} ms, steps = {got}{'' if good else '  WRONG, want ' + want}")

        # Live: child 0 is paused only while its state is saved; its pages are copied after.
        deeper = children[0].branch(deeper_tag, mode="live")
        (grandchild,) = client.spawn(deeper_tag, n=1)
        live.append(grandchild)
        got = grandchild.eval("steps")
        good = got == str([0, 1, 4, 100])
        ok &= good
        lb = deeper.branch
        assert lb is not None
        print(
            f"  {deeper.tag} (a live branch of child 0, paused {lb.pause_us / 1000:.2f} ms) -> "
            f"{grandchild.id}: steps = {got}{'' if good else '  WRONG'}"
        )
    except (tine.TineError, tine.EvalError) as e:
        print(f"failed: {e}", file=sys.stderr)
        ok = False
    finally:
        for sb in live:
            try:
                sb.kill()
            except tine.TineError as e:
                print(f"kill {sb.id}: {e}", file=sys.stderr)
        try:
            client.delete_snapshot(branch_tag, cascade=True)
        except tine.TineError as e:
            print(f"deleting {branch_tag}: {e}", file=sys.stderr)
    print("every child kept the state from before the branch" if ok else "SOME CHILD SAW THE WRONG STATE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
