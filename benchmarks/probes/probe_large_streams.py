"""Held memory and speed with large tasks on N streams instead of ``auto``'s 2.

qr's held excess is its large allocations' free blocks cached in a second stream's arena
(``h200-turns-2488533``: 1.35x plain sync on ``auto``, 1.01x on one stream, but 0.94x
plain sync's speed there, with every task on that stream). This runs ``bench_workloads``
with ``Auto.large_streams`` set to ``--large-streams`` for the whole process (the other
arguments go to ``bench_workloads``), so large tasks go to that many streams and the
others to all of them::

    python -m benchmarks.probes.probe_large_streams --large-streams 1 --backend cupy \\
        --workloads qr,delayed --modes sync,launcher --samples 2 --rounds 2
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import bench_workloads
from dask_gpustreams.runtime.policies.affinity import Auto


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.probe_large_streams")
    p.add_argument("--large-streams", type=int, required=True)
    args, rest = p.parse_known_args(argv)
    if args.large_streams < 1:
        p.error(f"--large-streams {args.large_streams} is invalid: it needs an int >= 1")
    Auto.large_streams = args.large_streams
    print(f"Auto.large_streams = {Auto.large_streams}", flush=True)
    return bench_workloads.main(rest)


if __name__ == "__main__":
    sys.exit(main())
