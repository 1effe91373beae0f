"""Where a ``distributed`` run loses time between dependent tasks (diagnostic probe).

Runs the wide shapes on one worker with the plugin on, logging every task
transition on the worker and on the scheduler (one monotonic clock: same
host). For each dependency edge that gated its consumer (the consumer's last
input to finish), it splits the time from the producer finishing on the
worker to the consumer executing there into: worker -> scheduler report,
scheduler decision, scheduler -> worker message, and the worker's queue.
Each variant changes one setting of the running cluster:

- ``default``: as started;
- ``batch0``: the worker's and the scheduler's batched-send intervals at 0;
- ``noprofile``: the worker's statistical profiler stopped;
- ``batch0+noprofile``: both;
- ``switch``: the worker's GIL switch interval at 0.5 ms (default 5 ms);
- ``plugin-off``: the plugin unregistered (kernels on the legacy default
  stream, serialized on the device, but launched as asynchronously): the
  latencies of distributed itself.

``--profile-loop`` instead profiles (cProfile) the event loops of the worker
and the scheduler over ``--reps`` runs of each shape and prints where they spend
their time. ``--hook-times`` instead times, on the worker, each call of the
plugin's ``transition`` hook and its ``Execution.prepare``, of
``StreamRuntime.run``, of the kernel launch inside it and (with CuPy) of
``cupy.empty`` inside that, with the plugin on; ``transition`` also by the state the key
goes to. The hook is timed in a first pass, the calls inside it and the task's in a
second, so no timer stands inside another's window; the wall clock's window holds two
``perf_counter`` reads and the wrapper's call. The second pass also times, with the same
wrapper, the empty ``transition`` hook of a plugin of the probe's (``EmptyHook.transition``):
the timer's own share of each call's figures, under the same load (they keep it).
``--blocks`` is the plugin's stream blocks setting, ``off`` (as shipped) unless given.

::

    python -m benchmarks.probe_distributed --shapes linear,tangled --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from unittest import mock

from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin

from benchmarks import bench_shapes as bs

VARIANTS = ("default", "batch0", "noprofile", "batch0+noprofile", "switch", "plugin-off")


class WorkerLog(WorkerPlugin):
    name = "probe-worker-log"

    def setup(self, worker):
        self.log = []
        worker._probe_log = self.log

    def transition(self, key, start, finish, **kwargs):
        self.log.append((key, finish, time.perf_counter()))


class EmptyHook(WorkerPlugin):
    """A ``transition`` hook that does nothing: timed, the cost of the timer itself."""

    name = "probe-empty-hook"

    def transition(self, key, start, finish, **kwargs):
        pass


class SchedulerLog(SchedulerPlugin):
    name = "probe-scheduler-log"

    async def start(self, scheduler):
        self.log = []
        scheduler._probe_log = self.log

    def transition(self, key, start, finish, *args, **kwargs):
        self.log.append((key, finish, time.perf_counter()))


def _take_worker_log(dask_worker):
    log = list(dask_worker._probe_log)
    dask_worker._probe_log.clear()
    return log


def _take_scheduler_log(dask_scheduler):
    log = list(dask_scheduler._probe_log)
    dask_scheduler._probe_log.clear()
    return log


def _set_worker(dask_worker, batch: float | None, profile: bool, switch: float):
    sys.setswitchinterval(switch)
    if batch is not None:
        dask_worker.batched_stream.interval = batch
    for name in ("profile", "profile-cycle"):
        pc = dask_worker.periodic_callbacks.get(name)
        if pc is not None:
            pc.start() if profile else pc.stop()


def _set_scheduler(dask_scheduler, batch: float | None):
    for comm in dask_scheduler.stream_comms.values():
        comm.interval = batch if batch is not None else 0.005


def _profile_start(dask_worker=None, dask_scheduler=None):
    import cProfile

    server = dask_worker or dask_scheduler
    server._probe_profile = cProfile.Profile()
    server._probe_profile.enable()  # client.run calls this on the server's event loop


def _profile_stop(dask_worker=None, dask_scheduler=None) -> str:
    import io
    import pstats

    server = dask_worker or dask_scheduler
    server._probe_profile.disable()
    out = io.StringIO()
    stats = pstats.Stats(server._probe_profile, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(30)
    return out.getvalue()


def profile_loops(client, prepare, reps: int) -> None:
    prepare(("warm",))()
    client.run(_profile_start)
    client.run_on_scheduler(_profile_start)
    t0 = time.perf_counter()
    for rep in range(reps):
        prepare(("profiled", rep))()
    wall = time.perf_counter() - t0
    for name, text in (
        ("worker", next(iter(client.run(_profile_stop).values()))),
        ("scheduler", client.run_on_scheduler(_profile_stop)),
    ):
        print(f"==== {name} event loop, {reps} runs in {wall:.2f} s ====")
        print(text)


def _prepare_profile_start(dask_worker):
    """Profile (cProfile) ``Execution.prepare`` alone: what it calls, per task, on this worker."""
    import cProfile

    from dask_gpustreams.integrations.distributed.execution import Execution

    profile = dask_worker._prepare_profile = cProfile.Profile()
    original = Execution.prepare

    def prepare(self, key):
        profile.enable()
        try:
            return original(self, key)
        finally:
            profile.disable()

    dask_worker._prepare_patch = mock.patch.object(Execution, "prepare", prepare)
    dask_worker._prepare_patch.start()


def _prepare_profile_stop(dask_worker) -> str:
    import io
    import pstats

    dask_worker._prepare_patch.stop()
    out = io.StringIO()
    stats = pstats.Stats(dask_worker._prepare_profile, stream=out)
    stats.sort_stats("tottime").print_stats(25)
    return out.getvalue()


def profile_prepare(client, prepare, reps: int) -> None:
    """``--profile-prepare``: where ``Execution.prepare``'s time goes, by function."""
    prepare(("warm",))()
    client.run(_prepare_profile_start)
    for rep in range(reps):
        prepare(("prepare-profiled", rep))()
    print("==== Execution.prepare (cProfile inside it only) ====")
    print(next(iter(client.run(_prepare_profile_stop).values())))


def _install_hook_timers(dask_worker, hook: bool):
    """Wrap the plugin's hook (``hook``), else the calls inside it and the task's, with timers.

    Apart, so that no timer stands inside another's window.
    """
    from collections import defaultdict

    from benchmarks.kernels import Spin
    from dask_gpustreams.integrations.distributed.execution import Execution
    from dask_gpustreams.integrations.distributed.plugin import StreamsPlugin
    from dask_gpustreams.runtime.runtime import StreamRuntime

    times = dask_worker._hook_times = defaultdict(list)
    patches = dask_worker._hook_patches = []

    def timed(cls, name):
        original = getattr(cls, name)
        label = f"{getattr(cls, '__name__', cls)}.{name}"
        by_finish = cls is StreamsPlugin

        def wrapper(*args, **kwargs):
            # The thread's CPU clock is a system call: read outside the wall clock's window.
            c0 = time.thread_time()
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                pair = (t1 - t0, time.thread_time() - c0)
                times[label].append(pair)
                if by_finish:  # (plugin, key, start, finish): also by finish state
                    times[f"{label} ->{args[3]}"].append(pair)

        patch = mock.patch.object(cls, name, wrapper)
        patch.start()
        patches.append(patch)

    if hook:
        targets = [(StreamsPlugin, "transition")]
    else:
        targets = [(Execution, "prepare"), (StreamRuntime, "run"), (Spin, "__call__")]
        try:
            import cupy

            targets.append((cupy, "empty"))  # the launch's allocation, from the memory pool
        except ImportError:
            pass
        targets.append((EmptyHook, "transition"))  # the timer's own cost
    for cls, name in targets:
        timed(cls, name)


def _remove_hook_timers(dask_worker):
    """Restore what ``_install_hook_timers`` wrapped (in-process workers share the classes)."""
    for patch in reversed(dask_worker._hook_patches):
        patch.stop()
    dask_worker._hook_patches.clear()


def _take_hook_times(dask_worker):
    times = {k: list(v) for k, v in dask_worker._hook_times.items()}
    dask_worker._hook_times.clear()
    return times


def hook_times(dist, loads, shapes: str, reps: int) -> None:
    """Per shape and hook: calls per task, median and mean us per call, ms per run, us per task.

    ``us/task`` is wall time: it includes the waits of the event loop for the GIL while the
    worker's task thread holds it (a task's launch releases and retakes it, so the loop is
    stopped mid-hook for up to the switch interval); ``cpu us/task`` is the loop thread's own
    CPU time in the hook (``time.thread_time``), its cost without those waits.
    """
    client = dist.client
    per_task = {}
    for hook in (True, False):  # the hook alone, then what is inside it and the task
        if not hook:
            client.register_plugin(EmptyHook())
        client.run(_install_hook_timers, hook=hook)
        try:
            per_task.update(_hook_rows(dist, loads, shapes, reps))
        finally:
            client.run(_remove_hook_timers)
            if not hook:
                client.unregister_worker_plugin(EmptyHook.name)
    # The empty hook's us/task is the timer's and a hook call's own cost, in the same shapes.
    print(f"{'shape':10} {'hook us/task':>12} {'empty hook':>10} {'net':>6}")
    for name in shapes.split(","):
        hook, empty = (per_task.get((name, c)) for c in ("StreamsPlugin", "EmptyHook"))
        if hook is not None and empty is not None:
            print(f"{name:10} {hook:12.1f} {empty:10.1f} {hook - empty:6.1f}")


def _hook_rows(dist, loads, shapes: str, reps: int) -> dict[tuple[str, str], float]:
    """Print the rows of each shape; return (shape, class) -> us a task of each class's hook."""
    client = dist.client
    per_task = {}
    print(
        f"{'shape':10} {'call':38} {'per task':>8} {'median us':>10} {'mean us':>8} "
        f"{'ms/run':>7} {'us/task':>8} {'cpu us/task':>11}"
    )
    for name in shapes.split(","):
        wl = loads.get("distributed", "wide", name)
        prepare = dist.prepare(wl)
        prepare(("hooks-warm", name))()
        client.run(_take_hook_times)
        for rep in range(reps):
            results = prepare(("hooks", name, rep))()
            error = wl.check(list(results))
            if error:
                print(f"{name}: WRONG RESULT {error}")
        times = next(iter(client.run(_take_hook_times).values()))
        tasks = reps * len(wl.shape.nodes)
        for label, pairs in sorted(times.items()):
            values = [wall for wall, _ in pairs]
            cpu = sum(c for _, c in pairs)
            print(
                f"{name:10} {label:38} {len(values) / tasks:8.2f} "
                f"{statistics.median(values) * 1e6:10.1f} "
                f"{statistics.mean(values) * 1e6:8.1f} {sum(values) / reps * 1e3:7.2f} "
                f"{sum(values) / tasks * 1e6:8.1f} {cpu / tasks * 1e6:11.1f}",
                flush=True,
            )
            cls, _, method = label.partition(".")
            if method == "transition":  # all finishes together, not one of them
                per_task[(name, cls)] = sum(values) / tasks * 1e6
    return per_task


def first(log, finish):
    out = {}
    for key, f, t in log:
        if f == finish and key not in out:
            out[key] = t
    return out


def breakdown(wl, token, wlog, slog) -> dict:
    """Median ms of each leg of the gating edges; time from first execute to last memory."""
    w_exec, w_mem = first(wlog, "executing"), first(wlog, "memory")
    w_recv = {}
    for key, f, t in wlog:
        if key not in w_recv and f in ("waiting", "ready", "fetch", "constrained"):
            w_recv[key] = t
    s_mem, s_proc = first(slog, "memory"), first(slog, "processing")
    legs = {"report": [], "decide": [], "send": [], "queue": [], "run": [], "step": []}
    deps = {n.key + (token,): [a + (token,) for a in n.args] for n in wl.shape.nodes}
    for child, parents in deps.items():
        parents = [p for p in parents if p in w_mem]
        if not parents or child not in w_exec:
            continue
        p = max(parents, key=lambda k: w_mem[k])
        try:
            legs["report"].append(s_mem[p] - w_mem[p])
            legs["decide"].append(s_proc[child] - s_mem[p])
            legs["send"].append(w_recv[child] - s_proc[child])
            legs["queue"].append(w_exec[child] - w_recv[child])
            legs["run"].append(w_mem[child] - w_exec[child])
            legs["step"].append(w_exec[child] - w_mem[p])
        except KeyError:
            continue
    out = {k: statistics.median(v) * 1e3 for k, v in legs.items() if v}
    out["span"] = (max(w_mem.values()) - min(w_exec.values())) * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cupy", choices=("cupy", "sim"))
    p.add_argument("--shapes", default="linear,diamond,chainlink,tangled")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kernel-ms", type=float, default=8.0)
    p.add_argument("--threads", type=int, default=8, help="threads of the worker")
    p.add_argument("--profile-loop", action="store_true")
    p.add_argument("--hook-times", action="store_true")
    p.add_argument("--profile-prepare", action="store_true")
    p.add_argument("--switch", type=float, default=0.005, help="worker's GIL switch interval")
    p.add_argument(
        "--blocks", default="off", choices=("auto", "off"), help="stream blocks (default: off)"
    )
    a = p.parse_args(argv)
    args = bs.parse_args(
        ["--backend", a.backend, "--schedulers", "distributed", "--families", "wide"]
        + ["--dist-kernel-ms", str(a.kernel_ms), "--threads", str(a.threads)]
    )
    bs.set_defaults(args, a.backend)
    loads = bs.Workloads(args, a.backend, bs.calibrate(args, a.backend))
    dist = bs.Distributed(args, a.backend)
    client = dist.client
    client.register_plugin(WorkerLog())
    client.register_plugin(SchedulerLog())
    dist.use_streams(8, "auto", blocks=a.blocks)
    if a.hook_times:
        client.run(_set_worker, batch=None, profile=True, switch=a.switch)
        try:
            hook_times(dist, loads, a.shapes, a.reps)
        finally:
            client.run(_set_worker, batch=None, profile=True, switch=0.005)
            dist.close()
        return 0
    if a.profile_prepare:
        for name in a.shapes.split(","):
            profile_prepare(client, dist.prepare(loads.get("distributed", "wide", name)), a.reps)
        dist.close()
        return 0
    if a.profile_loop:
        for name in a.shapes.split(","):
            profile_loops(client, dist.prepare(loads.get("distributed", "wide", name)), a.reps)
        dist.close()
        return 0
    print(
        f"{'shape':10} {'variant':18} {'wall ms':>8} {'sat':>5} | median ms per gating edge: "
        "report decide  send queue   run  step"
    )
    for name in a.shapes.split(","):
        wl = loads.get("distributed", "wide", name)
        ideal_ms = wl.kernel_ms * len(wl.shape.nodes)
        prepare = dist.prepare(wl)
        for variant in a.variants.split(","):
            if (variant == "plugin-off") != (dist.plugin_name is None):
                dist.use_streams(None if variant == "plugin-off" else 8, "auto", blocks=a.blocks)
            batch = 0.0 if "batch0" in variant else None
            switch = 0.0005 if variant == "switch" else 0.005
            client.run(_set_worker, batch=batch, profile="noprofile" not in variant, switch=switch)
            client.run_on_scheduler(_set_scheduler, batch=batch)
            rows = []
            for rep in range(a.reps + 1):
                token = ("probe", name, variant, rep)
                run = prepare(token)
                client.run(_take_worker_log)
                client.run_on_scheduler(_take_scheduler_log)
                t0 = time.perf_counter()
                results = run()
                wall = (time.perf_counter() - t0) * 1e3
                err = wl.check(list(results))
                wlog = next(iter(client.run(_take_worker_log).values()))
                slog = client.run_on_scheduler(_take_scheduler_log)
                if rep:
                    rows.append((wall, breakdown(wl, token, wlog, slog), err))
            wall = statistics.median(r[0] for r in rows)
            legs = {k: statistics.median(r[1].get(k, 0) for r in rows) for k in rows[0][1]}
            errors = [r[2] for r in rows if r[2]]
            print(
                f"{name:10} {variant:18} {wall:8.1f} {ideal_ms / wall:5.2f} |"
                + "".join(
                    f" {legs.get(k, float('nan')):6.2f}"
                    for k in ("report", "decide", "send", "queue", "run", "step")
                )
                + (f"  ERR {errors[0]}" if errors else ""),
                flush=True,
            )
    dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
