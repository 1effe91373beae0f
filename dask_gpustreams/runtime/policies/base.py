"""The stream-assignment policy interface and its registry of names."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence

from dask_gpustreams.config import Registry
from dask_gpustreams.runtime.pool import PoolView, StreamSlot
from dask_gpustreams.runtime.registry import EventRegistry, TaskRecord


class TaskInfo:
    """What a policy may know about a task when it picks its stream.

    ``producers`` are the records of the task's inputs produced by this
    runtime (same device, same process), in input order. ``critical`` is True
    for tasks on a longest path of their graph, where the integration knows it.
    ``large`` is True for a task of a group whose earlier task allocated a block
    of at least ``gpustreams.large-tasks`` bytes, where the launcher knows it.
    Made once per task, so a plain class: policies read it and change nothing.
    """

    __slots__ = ("key", "producers", "registry", "critical", "large")

    def __init__(
        self,
        key: Hashable,
        producers: Sequence[TaskRecord],
        registry: EventRegistry,
        critical: bool | None = None,
        large: bool = False,
    ) -> None:
        self.key = key
        self.producers = producers
        self.registry = registry
        self.critical = critical
        self.large = large

    def __repr__(self) -> str:
        return (
            f"TaskInfo(key={self.key!r}, producers={len(self.producers)}, "
            f"critical={self.critical}, large={self.large})"
        )


class StreamPolicy(ABC):
    """Picks the stream a task runs on. One instance serves one pool, from many threads."""

    #: Name used in ``gpustreams.policy``.
    name: str = ""

    def high_priority_streams(self, n_streams: int) -> int:
        """How many of the pool's streams should get the device's top priority."""
        return 0

    #: Whether the integration should compute :attr:`TaskInfo.critical`.
    needs_critical_path: bool = False
    #: How many streams large tasks (:attr:`TaskInfo.large`) run on; None: any. The stream
    #: launcher then launches at most that many large tasks a round, so that the large
    #: paths it keeps in flight are no more than their streams run.
    large_streams: int | None = None

    @abstractmethod
    def select(self, task: TaskInfo, pool: PoolView) -> StreamSlot:
        """The slot of ``pool`` that ``task`` runs on (called under the pool's assign lock)."""


#: The values of ``gpustreams.policy``: the registered policies' factories.
POLICIES: Registry[Callable[[], StreamPolicy]] = Registry("policy")


def register_policy(cls: type[StreamPolicy]) -> type[StreamPolicy]:
    """Class decorator making ``cls`` available as ``gpustreams.policy: <cls.name>``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty 'name' to be registered")
    POLICIES.register(cls.name, cls)
    return cls


def policy_names() -> tuple[str, ...]:
    """The registered policy names."""
    return POLICIES.names()


def make_policy(name: str) -> StreamPolicy:
    """A new instance of the policy registered as ``name``."""
    return POLICIES.get(name)()


def least_loaded(pool: PoolView, slots: Sequence[StreamSlot]) -> StreamSlot:
    """The slot among ``slots`` with the least work not yet completed (by completion events)."""
    best = slots[0]
    best_load = pool.load(best)
    for slot in slots[1:]:
        if best_load == 0:
            break
        load = pool.load(slot)
        if load < best_load:
            best, best_load = slot, load
    return best
