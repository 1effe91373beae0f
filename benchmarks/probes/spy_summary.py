"""Summarize ``py-spy record --format raw`` output: where one thread's time goes.

Keeps the samples whose stack holds ``--root`` (default: a compute of
``probe_dagger_loop``) and prints the ``--top`` frames by inclusive and by self
share, a frame being ``function (file:line)`` with the line dropped, so a function
counts once a stack.

    python -m benchmarks.probes.spy_summary launcher.txt --top 40
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

_LINE = re.compile(r":\d+\)$")


def frame_name(frame: str) -> str:
    """``'f (path/x.py:12)'`` -> ``'f (path/x.py)'``; native frames as they are."""
    return _LINE.sub(")", frame)


def summarize(path: str, root: str) -> tuple[int, Counter, Counter]:
    """(samples kept, inclusive counts, self counts) of ``path``'s stacks holding ``root``."""
    inclusive: Counter = Counter()
    leaf: Counter = Counter()
    kept = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if root not in stack:
                continue
            n = int(count)
            kept += n
            frames = [frame_name(x) for x in stack.split(";")]
            for name in set(frames):
                inclusive[name] += n
            leaf[frames[-1]] += n
    return kept, inclusive, leaf


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.spy_summary")
    p.add_argument("files", nargs="+")
    p.add_argument("--root", default="main.<locals>.<lambda>")
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args(argv)
    for path in args.files:
        kept, inclusive, leaf = summarize(path, args.root)
        print(f"== {path}: {kept} samples holding {args.root!r}")
        for title, counts in (("inclusive", inclusive), ("self", leaf)):
            print(f"-- {title}")
            for name, n in counts.most_common(args.top):
                print(f"{100 * n / max(kept, 1):6.1f}%  {name[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
