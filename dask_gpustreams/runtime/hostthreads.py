"""The threads that run the launcher's host tasks: started by work, ended when idle.

A runtime kept open between computes (a shared one, see :mod:`.lifetime`)
should hold no threads while no compute uses it: distributed's thread-leak
check, and a process with many settings, see every thread left behind. So each
thread ends after :attr:`HostThreads.idle_timeout` seconds without work, and
the next task starts one again (back-to-back computes keep theirs).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("dask_gpustreams")


class HostThreads:
    """Up to ``size`` daemon threads that run submitted calls in submission order.

    Unlike a ``ThreadPoolExecutor``, whose threads live until it shuts down,
    each thread ends after :attr:`idle_timeout` seconds without work. Calls
    return nothing to the submitter: they report their own outcome. A call
    that raises is logged.
    """

    #: Seconds without work after which a thread ends (the next call starts one).
    idle_timeout = 0.5

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._work: deque[tuple[Callable, tuple]] = deque()
        lock = threading.Lock()
        self._more = threading.Condition(lock)  # work came, or shutdown
        self._ended = threading.Condition(lock)  # a thread ended
        self._threads: set[threading.Thread] = set()  # running (each adds itself)
        self._count = 0  # threads started, running or ending
        self._idle = 0  # threads waiting for work
        self._ids = 0
        self._shutdown = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on one of the threads (a new one if none is idle and there is room).

        Raises ``RuntimeError`` after :meth:`shutdown`.
        """
        thread = None
        with self._more:
            if self._shutdown:
                raise RuntimeError(f"cannot run host tasks on {self._name!r} after shutdown")
            work = self._work
            work.append((fn, args))
            if len(work) > self._idle and self._count < self._size:
                self._count += 1
                self._ids += 1
                thread = threading.Thread(
                    target=self._serve, name=f"{self._name}_{self._ids}", daemon=True
                )
            elif self._idle:
                self._more.notify()
        if thread is not None:
            thread.start()  # unlocked: the new thread takes the call at once

    def threads(self) -> set[threading.Thread]:
        """The threads running now (a snapshot)."""
        with self._more:
            return set(self._threads)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new calls; the threads end once the queued ones have run (joined if ``wait``).

        Called from one of its threads, ``wait`` waits for the others.
        """
        me = threading.current_thread()
        with self._more:
            self._shutdown = True
            self._more.notify_all()
            if not wait:
                return
            self._ended.wait_for(lambda: self._count == (me in self._threads))
            threads = set(self._threads) - {me}
        for thread in threads:
            thread.join()

    def _serve(self) -> None:
        me = threading.current_thread()
        more = self._more
        work = self._work
        with more:
            self._threads.add(me)
        while True:
            with more:
                while not work:
                    if self._shutdown or not self._wait_for_work():
                        self._threads.discard(me)
                        self._count -= 1
                        self._ended.notify_all()
                        return
                fn, args = work.popleft()
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a call reports its own outcome
                logger.exception("gpustreams: host call %r raised", fn)
            del fn, args

    def _wait_for_work(self) -> bool:
        """Wait up to :attr:`idle_timeout` for work or shutdown; False if idle all along. Locked."""
        self._idle += 1
        try:
            notified = self._more.wait(self.idle_timeout)
        finally:
            self._idle -= 1
        return notified or bool(self._work)
