"""Task functions of :mod:`benchmarks.fuzz_registrations` (found by reference in-process)."""

from __future__ import annotations

import threading
import time

import numpy as np

from dask_gpustreams import sim

#: gate id -> threading.Event, opened by the fuzzer (tasks find it by reference).
GATES: dict[int, threading.Event] = {}
#: gate ids whose gated task gave up waiting (a hang guard, reported as a finding).
GATE_TIMEOUTS: list[int] = []


def _fill(out, value, seconds):
    time.sleep(seconds)
    out[...] = value


#: key -> whether the task ran off the pool streams (the device's default stream).
OFF_STREAMS: dict = {}


def _note():
    try:
        from distributed import get_worker

        key = get_worker().get_current_task()
    except Exception:
        return
    OFF_STREAMS[key] = not on_a_pool_stream()


def produce(n, value, seconds=0.0):
    _note()
    out = sim.empty(n)
    sim.launch(_fill, out, value, seconds)
    return out


def gated_produce(n, value, gate_id):
    """Waits in its worker thread for its gate (at most 20 s), then launches its kernel."""
    if not GATES[gate_id].wait(20):
        GATE_TIMEOUTS.append(gate_id)
    return produce(n, value)


def slow_produce(n, value, seconds):
    time.sleep(seconds)  # in the task's thread
    return produce(n, value)


def _add(out, a, b, seconds):
    time.sleep(seconds)
    np.add(a, b, out=out)


def add(a, b, seconds=0.0):
    _note()
    out = sim.empty(a.shape)
    sim.launch(_add, out, a, b, seconds)
    return out


def values(array):
    return sim.asnumpy(array)


def on_a_pool_stream():
    device = sim.get_device()
    return device.current_stream() is not device.default_stream


def snapshot(dask_worker):
    """The worker's plugin state, read on its event loop (client.run)."""
    from dask_gpustreams.integrations.distributed.plugin import LATEST, StreamsPlugin

    plugins = []
    for name, p in dask_worker.plugins.items():
        if isinstance(p, StreamsPlugin):
            rt = p.runtime if p._active else None
            plugins.append(
                dict(
                    name=name,
                    id=id(p),
                    repr=repr(p),
                    active=p._active,
                    error=repr(p.error) if p.error is not None else None,
                    displaced=p._displaced,
                    streams=p.overrides.get("streams"),
                    runtime_closed=None if rt is None else rt.closed,
                )
            )
    latest = LATEST.get(dask_worker)
    return dict(
        plugins=plugins,
        names=list(dask_worker.plugins),
        get_data_plain=dask_worker.handlers["get_data"] == dask_worker.get_data,
        latest=None if latest is None else (id(latest), repr(latest), latest._active),
    )


def _fill_after_gate(out, value, gate_id):
    GATES[gate_id].wait(20)
    out[...] = value


def gated_kernel(n, value, gate_id=0):
    """Returns at once; its kernel waits for the gate, then writes ``value``."""
    out = sim.empty(n)
    sim.launch(_fill_after_gate, out, value, gate_id)
    return out
