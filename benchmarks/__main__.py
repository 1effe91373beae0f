"""``python -m benchmarks``: run the suite, compare two result files, list the benchmarks.

::

    python -m benchmarks run [--quick] [--backend sim|cupy] [--only NAMES] [--out DIR]
    python -m benchmarks compare OLD.json NEW.json [--threshold 1.1] [--fail-on-regression]
    python -m benchmarks list

See ``docs/benchmarks.md``; ``benchmarks/suite.py`` and ``benchmarks/compare.py`` say what
each writes and how a regression is told from noise.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import compare, suite


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    suite.add_run_arguments(sub.add_parser("run", help="run the registered benchmarks"))
    compare.add_compare_arguments(sub.add_parser("compare", help="ratios of two result files"))
    sub.add_parser("list", help="the registered benchmarks")
    args = p.parse_args(argv)
    if args.what == "run":
        args.command = argv
        return suite.run(args)
    if args.what == "compare":
        try:
            return compare.main(args)
        except (OSError, ValueError, KeyError) as e:
            p.error(f"compare: {e}")
    return suite.list_benchmarks()


if __name__ == "__main__":
    sys.exit(main())
