"""Where does the launcher's time go on std / small-chunks, against plain sync? (cProfile)

Answered: nowhere that the launcher owns (H200 at 71dc3df, benchmarks/results/h200-misc/
launcher-profile-71dc3df.txt): dask's order() of each fused subgraph and CuPy's calls lead
both profiles, and the H200 host's walls drift (plain sync's std 260 to 438 ms in 5 runs).

    python -m benchmarks.probes.probe_launcher_profile std,small-chunks
"""

import cProfile
import io
import pstats
import statistics
import sys
import time

import cupy
import dask

from benchmarks import bench_workloads as bw


def main():
    names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["std"]
    arrays = bw.make_arrays("cupy")
    sizes = bw.sizes_for("cupy", False)
    for name in names:
        wl = bw.WORKLOADS[name]
        cols = wl.build(arrays, sizes[name])
        for sched in ("sync", "gpustreams"):
            with dask.config.set({"gpustreams.enabled": False}):
                dask.compute(*cols, scheduler=sched)
                cupy.cuda.Device().synchronize()
                walls = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    dask.compute(*cols, scheduler=sched)
                    cupy.cuda.Device().synchronize()
                    walls.append((time.perf_counter() - t0) * 1e3)
                pr = cProfile.Profile()
                pr.enable()
                dask.compute(*cols, scheduler=sched)
                cupy.cuda.Device().synchronize()
                pr.disable()
            out = io.StringIO()
            st = pstats.Stats(pr, stream=out)
            st.sort_stats("tottime").print_stats(22)
            median = statistics.median(walls)
            print(f"==== {name} {sched}: median {median:.1f} ms {[round(w) for w in walls]}")
            print("\n".join(out.getvalue().splitlines()[:45]))


if __name__ == "__main__":
    main()
