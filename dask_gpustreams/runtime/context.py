"""The task the runtime is running in this thread, for code called from inside it."""

from __future__ import annotations

import threading
from typing import Any

#: ``runtime``, ``stream`` and ``holds`` of the running task; set by ``StreamRuntime.run``.
task_state = threading.local()


def active_task() -> tuple[Any, Any, list | None]:
    """``(runtime, stream, holds)`` of the task the runtime runs in this thread, or Nones.

    ``holds`` collects device arrays created by the task that must outlive its
    kernels (they are kept until the task's event completes).
    """
    return (
        getattr(task_state, "runtime", None),
        getattr(task_state, "stream", None),
        getattr(task_state, "holds", None),
    )
