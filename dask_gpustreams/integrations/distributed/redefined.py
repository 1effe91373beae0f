"""On the worker: a key that a stream block defines anew drops the dependencies it had.

distributed takes a key's definition to be fixed: a worker's ``_handle_compute_task``
adds the dependencies a compute-task message names to the key's task and never drops
one. A block gives the keys it makes other dependencies (its inputs, or its own task for
a getter). A key that the scheduler forgot while a worker still held it (a dependency of
a task cancelled while it ran there, such as a computation released mid-run and run
again), made again inside a block, would wait on that worker for its first dependencies,
forever. :func:`drop_stale_dependencies` drops them first. For a key made again with its
own definition, as task per key makes it, the message names the same dependencies, and
nothing changes.
"""

from __future__ import annotations

from typing import Any

#: Worker states of a task that a compute-task message may give a new definition.
_REDEFINABLE = frozenset({"released", "error", "fetch", "flight", "missing"})
#: ... and those of a task whose transfer goes on while nothing needs it (``previous``:
#: flight). The message resumes the transfer; if it fails, the task computes, and would
#: wait for the dependencies it had.
_IN_FLIGHT = frozenset({"cancelled", "resumed"})


def drop_stale_dependencies(worker: Any) -> None:
    """Wrap ``worker.handle_stimulus``: a task it is asked to compute loses the dependencies
    it knew that the scheduler no longer names; those then needed by nothing are forgotten.
    Tasks still executing (cancelled, resumed from executing) are left as they are; a
    cancelled transfer (from flight) is not, as it computes if the transfer fails."""
    from distributed.worker_state_machine import ComputeTaskEvent

    state = worker.state
    handle = worker.handle_stimulus
    if getattr(handle, "_gpustreams", False):
        return

    def handle_stimulus(*stims: Any) -> None:
        for ev in stims:
            if type(ev) is not ComputeTaskEvent:
                continue
            ts = state.tasks.get(ev.key)
            if ts is None or not (
                ts.state in _REDEFINABLE or (ts.state in _IN_FLIGHT and ts.previous == "flight")
            ):
                continue
            forget = {}
            for d in [d for d in ts.dependencies if d.key not in ev.who_has]:
                ts.dependencies.discard(d)
                d.dependents.discard(ts)
                ts.waiting_for_data.discard(d)
                d.waiters.discard(ts)
                if d.state == "released" and not d.dependents:
                    forget[d] = "forgotten"
            if forget:  # released -> forgotten: no instructions
                state._transitions(forget, stimulus_id=ev.stimulus_id)
        handle(*stims)

    handle_stimulus._gpustreams = True  # type: ignore[attr-defined]
    worker.handle_stimulus = handle_stimulus
