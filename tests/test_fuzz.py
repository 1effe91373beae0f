"""The random-DAG fuzzer (``benchmarks/fuzz.py``): a short fixed-seed run, and its self-check."""

from __future__ import annotations

import gc
import re
import subprocess
import sys
import threading

import dask
import numpy as np
import pytest
from distributed.diagnostics.plugin import SchedulerPlugin

from benchmarks import fuzz

SUMMARY = re.compile(
    r"^fuzz: (\d+) DAGs \((\d+) with a failing kernel, \d+ with several failing nodes\),"
    r" (\d+) wrong, (\d+) hangs,"
    r" (\d+) unexpected errors, (\d+) leaks, (\d+) slow \(over --timeout, not hung\), [\d.]+ s$"
)


def summary(out: str) -> tuple[int, ...]:
    """DAGs, failing, wrong, hangs, errors, leaks, slow of the summary line, which comes last."""
    match = SUMMARY.match(out.strip().splitlines()[-1])
    assert match, out
    return tuple(int(g) for g in match.groups())


@pytest.mark.parametrize(
    ("routes", "dags"), [("threaded,launcher", 160), ("distributed,distributed-spill", 40)]
)
def test_fixed_seed_run_is_exact(capsys, routes, dags):
    """Seed 6 has failing kernels, persists and array expressions on every route."""
    assert fuzz.main(["--seed", "6", "--dags", str(dags), "--routes", routes]) == 0
    out = capsys.readouterr().out
    n, failing, wrong, hangs, errors, leaks, _ = summary(out)
    assert (n, wrong, hangs, errors, leaks) == (dags, 0, 0, 0, 0), out
    for route in routes.split(","):
        row = re.search(rf"^{route} +(\d+) +(\d+) +0 +0 +0 +0 ", out, re.M)
        assert row and int(row[1]) == dags // 2 and int(row[2]) >= 1, out


def test_the_loss_route_closes_a_worker_in_each_dag_and_stays_exact(capsys):
    """``distributed-loss`` (named only): each DAG loses the worker with the most tasks in
    flight; its results and running tasks (blocks among them) are computed again."""
    args = fuzz.parse_args(["--seed", "6", "--routes", "distributed-loss"])
    assert args.routes == ["distributed-loss"]
    with fuzz.DistributedRoute("distributed-loss", "sim", timeout=30.0, seed=6) as route:
        tally = fuzz.run_route(route, args, quota=30, seconds=None)
        now = set(route.client.run(lambda: None))  # the workers' addresses
        started = {w.address for w in route.started}  # those started after a loss, alive
        assert route.losses == 30 and len(now) == fuzz.LOSS_WORKERS and started and started <= now
        assert route.interrupted >= 5  # workers with tasks in flight (17 of 30 at seed 6)
    assert (tally.dags, tally.bad(), tally.failing >= 1) == (30, 0, True), capsys.readouterr().out


@pytest.mark.parametrize(
    ("mechanisms", "routes"),
    [("wait,hold", "threaded,launcher"), ("egress,spill,failure", "distributed,distributed-spill")],
)
def test_self_check_finds_each_broken_mechanism(capsys, mechanisms, routes):
    argv = ["--self-check", mechanisms, "--routes", routes, "--dags", "100"]
    assert fuzz.main(argv) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    for mechanism in mechanisms.split(","):
        found = rf"^self-check {mechanism}: [1-9]\d* wrong in \d+ DAGs \(found\)$"
        assert re.search(found, out, re.M), out


def test_dags_are_reproducible_and_their_values_stay_below_p():
    a, b = (fuzz.make_dag(5, "launcher", 17, "sim") for _ in range(2))
    assert a.describe() == b.describe()
    for x, y in zip(fuzz.reference(a), fuzz.reference(b), strict=True):
        np.testing.assert_array_equal(x, y)
    for i in range(50):
        for value in fuzz.reference(fuzz.make_dag(5, "threaded", i, "sim")):
            if value is not None:
                assert value.dtype == np.float64 and ((value >= 0) & (value < fuzz.P)).all()


def test_the_threaded_route_runs_dasks_threads_and_the_launcher_route_does_not(monkeypatch):
    """By name, an enabled compute on ``"threads"`` runs the launcher: the ``threaded`` route
    asks for Dask's threads as such, so that each task runs through the runtime there."""
    import dask.threaded

    calls = []
    get_async = dask.threaded.get_async
    monkeypatch.setattr(
        dask.threaded, "get_async", lambda *a, **k: calls.append(1) or get_async(*a, **k)
    )
    for route, expected in (("threaded", True), ("launcher", False)):
        calls.clear()
        dag = fuzz.make_dag(5, route, 3, "sim")
        with fuzz.LocalRoute(route, "sim", 60) as local:
            assert local.run(dag) == ("ok", "")
        assert bool(calls) is expected, route


def test_dask_cuda_route_is_refused_on_the_sim():
    """Named on the sim, the route fails at argument parsing, saying why (not skipped)."""
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.fuzz", "--routes", "launcher,dask-cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run
    assert run.stdout == ""
    assert run.stderr.splitlines()[-1] == (
        "python -m benchmarks.fuzz: error: --routes dask-cuda cannot run: it needs --backend"
        " cupy, not 'sim' (a dask-cuda worker is a process on a GPU; the sim runs the other"
        " routes)"
    )


def test_dask_cuda_route_needs_dask_cuda(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "dask_cuda", None)  # import dask_cuda raises ImportError
    with pytest.raises(SystemExit) as exit_:
        fuzz.parse_args(["--routes", "dask-cuda", "--backend", "cupy"])
    assert exit_.value.code == 2
    assert "error: --routes dask-cuda cannot run: dask-cuda is not installed (" in (
        capsys.readouterr().err
    )


def test_default_routes_run_on_the_sim():
    sim_routes = ["threaded", "launcher", "distributed", "distributed-spill"]
    assert fuzz.parse_args([]).routes == sim_routes
    assert fuzz.parse_args(["--backend", "cupy"]).routes == list(fuzz.SIM_ROUTES)


@pytest.fixture(scope="module")
def cluster_route():
    """The distributed route's cluster (plugin on, sim) with a 1.5 s ``--timeout``, a task
    per key (a stream block would make a chain of sleeps one task)."""
    with (
        dask.config.set({"gpustreams.blocks": "off"}),
        fuzz.DistributedRoute("distributed", "sim", timeout=1.5, seed=0) as route,
    ):
        route.start(0)
        yield route


def sleep_chain(n: int, seconds: float) -> fuzz.Dag:
    """An upload, then ``n`` host sleeps of ``seconds`` in a row (one task each)."""
    data = np.arange(8.0)
    nodes = [fuzz.Node("upload", (), (data,))]
    nodes += [fuzz.Node("host-sleep", (i,), (seconds,)) for i in range(n)]
    kw = {"streams": 1, "policy": "round-robin", "delay": (0.0, 0.0), "optimize": False}
    return fuzz.Dag("distributed", 0, "delayed", nodes, outputs=[n], **kw)


def test_a_cluster_that_keeps_finishing_tasks_is_slow_not_hung(cluster_route):
    """12 tasks of 0.3 s take 3.6 s at least, over the 1.5 s timeout, but a task finishes
    every 0.3 s: exact, not a hang (the fixed wait called DAG 53 of seed 0 on
    distributed-spill hung; plain distributed takes 73 s over it)."""
    assert cluster_route.run(sleep_chain(12, 0.3)) == fuzz.OK


def test_an_output_still_pending_after_the_livelock_bound_is_a_hang(cluster_route, monkeypatch):
    monkeypatch.setattr(fuzz, "LIVELOCK", 2)  # 3 s, under the chain's 3.6 s
    dag = sleep_chain(12, 0.3)
    outs = fuzz.build(dag, cluster_route.kernels, list)
    futures = cluster_route.client.compute(outs, optimize_graph=False)  # a task per sleep
    with pytest.raises(fuzz.Hang, match=r"^still pending after 3 s while tasks kept finishing"):
        cluster_route.result(futures[0])
    assert fuzz.compare(futures[0].result(timeout=30), np.arange(8.0)) is None  # only slow


RELEASE = threading.Event()


def blocked() -> int:
    """A task that finishes only once the test sets RELEASE (the cluster is in-process)."""
    assert RELEASE.wait(timeout=60)
    return 1


def test_a_cluster_where_no_task_finishes_is_hung(cluster_route):
    RELEASE.clear()
    future = cluster_route.client.submit(blocked, pure=False)
    try:
        stalled = r"^no task finished on the cluster for 1.5 s \(\d+ did\)$"
        with pytest.raises(fuzz.Hang, match=stalled):
            cluster_route.result(future)
    finally:
        RELEASE.set()
    assert future.result(timeout=30) == 1


class Keeper(SchedulerPlugin):
    """Wants one key of each graph on the scheduler for a client that never lets go."""

    name = "fuzz-test-keeper"

    def __init__(self) -> None:
        self.kept: list = []

    def update_graph(self, scheduler, *, keys, **kwargs) -> None:
        key = sorted(keys, key=str)[0]
        scheduler.client_desires_keys([key], client=self.name)
        self.kept.append(key)


def test_a_task_the_scheduler_keeps_is_a_leak(cluster_route, monkeypatch, capsys):
    """Once the fuzzer dropped a DAG's futures, a task still there is a leak: counted,
    printed with what keeps it (the client that wants it) and the command that runs the
    DAG again, and a problem."""
    cluster_route.settle()  # the DAGs that earlier tests ran on this cluster are not ours
    cluster_route.leaks.clear()
    monkeypatch.setattr(fuzz, "LEAK_WAIT", 0.3)
    keeper = Keeper()
    scheduler = cluster_route.cluster.scheduler

    async def add() -> None:
        scheduler.add_plugin(keeper)

    async def remove() -> None:
        scheduler.remove_plugin(name=keeper.name)
        scheduler.client_releases_keys(keeper.kept, keeper.name)

    cluster_route.cluster.sync(add)
    try:
        args = fuzz.parse_args(["--seed", "6", "--routes", "distributed", "--timeout", "30"])
        tally = fuzz.run_route(cluster_route, args, quota=2, seconds=None)
    finally:
        cluster_route.cluster.sync(remove)
    out = capsys.readouterr().out
    assert (tally.dags, tally.leaks, tally.bad()) == (2, 2, 2), out
    for index in (0, 1):
        leak = (
            r"^LEAK [1-9]\d* tasks stay on the scheduler [\d.]+ s after every future was"
            r" dropped: .*wanted by \['fuzz-test-keeper'\], .*"
            rf"\n  distributed dag {index} .*\n  again: python -m benchmarks.fuzz"
            rf" --seed 6 --routes distributed --start {index} --dags 1 --backend sim$"
        )
        assert re.search(leak, out, re.M), out


def test_a_local_hang_says_where_the_compute_thread_was():
    """A local compute past ``--timeout`` is a hang, printed with the stacks of the threads
    that run it (here, the host task still sleeping)."""
    dag = sleep_chain(1, 1.0)
    dag.route = "launcher"
    with fuzz.LocalRoute("launcher", "sim", timeout=0.2) as route:
        hung = route.thread
        outcome, detail = route.run(dag)
    # The compute left behind ends its sleep, then its thread; its runtime goes with it
    # (garbage), so no later test sees its memory.
    assert hung.join(timeout=30)
    gc.collect()
    assert outcome == "hang", detail
    assert detail.startswith("no result after 0.2 s; where the threads were:\n"), detail
    assert re.search(r"in host_sleep\n +time\.sleep\(seconds\)", detail), detail


def test_a_retried_node_fails_once_and_its_retry_gives_the_exact_value(cluster_route):
    """On a cluster, a node with ``retries=1`` whose first attempt raises: its retry runs
    (its token is attempted) and the outputs are exact."""
    data = np.arange(8.0)
    nodes = [fuzz.Node("upload", (), (data,)), fuzz.Node("affine", (0,), (3,))]
    kw = {"streams": 2, "policy": "round-robin", "delay": (0.0, 0.0), "retried": 1}
    dag = fuzz.Dag("distributed", 0, "delayed", nodes, outputs=[1], **kw)
    attempted = set(fuzz.ATTEMPTED)
    assert cluster_route.run(dag) == fuzz.OK
    assert len(fuzz.ATTEMPTED - attempted) == 1  # the first attempt raised; the retry passed
    assert "node 1 retried;" in dag.describe()


def test_a_retried_host_marked_node_waits_for_its_inputs_work(cluster_route):
    """A retried ``host-marked`` node keeps the ``host_task`` mark through ``FailsOnce``,
    so it waits on the host for its input's work (a 0.5 s kernel) before it reads it off
    the streams, and the output is exact. Unmarked, its retry ran a few ms after its first
    attempt and read the kernel's output unwritten: NaN, a wrong value of the fuzzer's own
    (``--seed 9003 --routes distributed-loss --start 1499 --dags 1``, 1 run in 30)."""
    assert fuzz.is_host_task(fuzz.FailsOnce(fuzz.host_marked))
    assert not fuzz.is_host_task(fuzz.FailsOnce(fuzz.add))
    nodes = [
        fuzz.Node("upload", (), (np.arange(8.0),)),
        fuzz.Node("slow", (0,), (0.5,)),
        fuzz.Node("host-marked", (1, 1)),
    ]
    kw = {"streams": 2, "policy": "round-robin", "delay": (0.0, 0.0), "retried": 2}
    dag = fuzz.Dag("distributed", 0, "delayed", nodes, outputs=[2], **kw)
    attempted = set(fuzz.ATTEMPTED)
    assert cluster_route.run(dag) == fuzz.OK
    assert len(fuzz.ATTEMPTED - attempted) == 1  # the first attempt raised; the retry passed
    assert fuzz.reference(dag)[2].tolist() == [(3 * (i + 1)) % fuzz.P for i in range(8)]


def test_a_retried_node_may_raise_its_first_error_only_where_a_kernel_fails():
    """A retried node whose first attempt failed with the failing kernel's error (queued
    behind it) has no retry left when its own first call raises: with a failing kernel in
    the DAG, ``RetriedError`` is an accepted outcome, as that kernel's error is; without
    one, it is an unexpected error (helper-72: seed 5120, DAG 2167)."""
    nodes = [
        fuzz.Node("upload", (), (np.arange(8.0),)),
        fuzz.Node("affine", (0,), (3,)),
        fuzz.Node("fail", (0,)),
    ]
    kw = {"streams": 2, "policy": "round-robin", "delay": (0.0, 0.0), "retried": 1}
    plain = fuzz.Dag("distributed", 0, "delayed", nodes, outputs=[1], **kw)
    failing = fuzz.Dag("distributed", 0, "delayed", nodes, outputs=[1, 2], failing=2, **kw)
    error = fuzz.RetriedError("the first attempt of a retried task fails")
    assert fuzz.blame(error, failing) == fuzz.OK
    assert fuzz.blame(error, plain) == (
        "error",
        "RetriedError: the first attempt of a retried task fails",
    )


def test_several_failing_nodes_are_blamed_only_where_the_oracle_allows():
    """A DAG with two failing kernels and a task that raises: a local compute may raise the
    error of any failing node it runs; an output on a cluster that of a raising task it
    derives from, or any failing kernel's of the DAG (queued behind it on its stream);
    another DAG's key, or a failing node computed by nothing, is unexpected."""
    nodes = [
        fuzz.Node("upload", (), (np.arange(8.0),)),  # 0
        fuzz.Node("fail", (0,)),  # 1
        fuzz.Node("affine", (0,), (3,)),  # 2: exact
        fuzz.Node("fail", (2,)),  # 3
        fuzz.Node("raise", (2,), ("raise-a",)),  # 4
        fuzz.Node("fail", (0,)),  # 5: no output derives from it
    ]
    kw = {"streams": 2, "policy": "round-robin", "delay": (0.0, 0.0)}
    extra = {3: "fail-b", 4: "raise-a", 5: "fail-c"}
    dag = fuzz.Dag("distributed", 0, "delayed", nodes, [1, 2, 3, 4], failing=1, **kw)
    dag.fail_key, dag.extra = "fail-a", extra
    assert dag.tainted() == [False, True, False, True, True, True]
    assert dag.computed() == {0, 1, 2, 3, 4}
    ok, raised = fuzz.KernelError("fail-a", "boom"), fuzz.TaskRaised("raise-a")
    assert [fuzz.blame(e, dag) for e in (ok, raised)] == [fuzz.OK] * 2
    for error in (fuzz.KernelError("fail-c", "boom"), fuzz.KernelError("fail-x", "boom")):
        assert fuzz.blame(error, dag)[0] == "error"
    assert fuzz.blame(fuzz.KernelError("fail-b", "boom"), dag, 2) == fuzz.OK  # queued
    assert fuzz._queued(fuzz.KernelError("fail-b", "boom"), dag, 2)
    assert not fuzz._queued(fuzz.KernelError("fail-b", "boom"), dag, 3)
    assert fuzz.blame(raised, dag, 4) == fuzz.OK
    assert fuzz.blame(raised, dag, 3) == ("error", "TaskRaised: raise-a")
    assert fuzz.check_local(dag, None, None)[0] == "wrong"
    assert "failing nodes [1, 3, 4, 5]" in dag.describe()


def test_some_failing_dags_have_several_failing_nodes_and_multi_0_has_none():
    dags = [fuzz.make_dag(5, "launcher", i, "sim") for i in range(300)]
    several = [d for d in dags if len(d.failures()) > 1]
    assert several and all(d.failing is not None for d in several)
    assert any(n.op == "raise" for d in several for n in d.nodes)
    assert not any(fuzz.make_dag(5, "launcher", i, "sim", multi=0).extra for i in range(300))
