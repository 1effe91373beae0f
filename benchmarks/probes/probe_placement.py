"""Where the launcher puts the wide shapes' tasks, in a process whose share of ``ideal`` is low.

``bench_shapes`` with 0.5 ms kernels gave 60-73% of ``ideal`` in some processes and 82-94%
in others, with either of two libraries (h200-revert-3e60518). This probe runs each wide
shape under the launcher (8 streams, ``auto``, timeline off) and ``ideal:layers`` in turn,
prints the share of the medians, and for the last launcher run: the streams each column's
tasks went to, the host-bound task groups (``HostTasks``) and the large ones
(``LargeTasks``) the runtime has learned. Run it in several processes to see both kinds::

    for i in 1 2 3 4; do python -m benchmarks.probes.probe_placement --backend cupy; done
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import dask

from benchmarks.probes.probe_shape_lag import (
    launcher_config,
    walls_against_ideal,
    wide_loads,
    wide_parser,
)
from dask_gpustreams.runtime import acquire_runtime


def main(argv: list[str] | None = None) -> int:
    args = wide_parser(__doc__).parse_args(argv)
    loads, ideal = wide_loads(args.backend, args.kernel_ms)
    config = launcher_config(args.backend)
    failed = False
    with dask.config.set(config):
        runtime = acquire_runtime()
    try:
        placed: dict = {}
        select = runtime.policy.select

        def noting(task, pool):
            slot = select(task, pool)
            placed[task.key] = slot.index
            return slot

        runtime.policy.select = noting

        def before(mode: str) -> None:  # only the last launcher run's placement is kept
            if mode == "launcher":
                placed.clear()

        for name in args.shapes.split(","):
            wl = loads.get("threaded", "wide", name)
            walls, problems = walls_against_ideal(
                wl, ideal, config, args.backend, args.reps, before
            )
            for problem in problems:
                print(f"{name} {problem}: WRONG")
                failed = True
            columns = defaultdict(list)
            for key, stream in placed.items():
                columns[key[0]].append((key[1], stream))
            launcher, hand = statistics.median(walls["launcher"]), statistics.median(walls["ideal"])
            print(f"{name:<10} launcher {launcher:6.2f} ms  ideal {hand:6.2f} ms  ", end="")
            print(f"share {hand / launcher:4.0%}")
            for column in sorted(columns):
                streams = "".join(str(s) for _, s in sorted(columns[column]))
                print(f"  {column}: {streams}")
        print("host-task groups:", runtime.host_tasks.groups())
        print("large groups:", sorted(runtime.large_tasks.groups()))
    finally:
        runtime.release()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
