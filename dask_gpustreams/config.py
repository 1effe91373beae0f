"""The ``gpustreams`` section of dask's configuration: defaults and validation.

Defaults live in ``gpustreams.yaml`` beside this file and are registered with
``dask.config.update_defaults`` at import, so ``DASK_GPUSTREAMS__ENABLED=True``
and ``dask.config.set({"gpustreams.streams": 4})`` work as for any dask key.
Values are validated by :meth:`StreamsConfig.from_dask_config` when a runtime
starts, so a bad value or an unknown ``gpustreams.*`` key fails the
``compute`` call, not a task deep in a graph.
"""

from __future__ import annotations

import difflib
import functools
import numbers
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Generic, TypeVar

import dask.config
import yaml
from dask.utils import parse_bytes

#: Values of ``gpustreams.blocks``: stream blocks on distributed (:mod:`.integrations.blocks`).
BLOCKS = ("auto", "off")
#: Values of ``gpustreams.launch-order``: how the stream launcher ranks ready tasks.
LAUNCH_ORDERS = ("dask", "depth-first")

#: Share of the host's memory (or of its cgroup limit, if lower) that
#: ``pinned-pool-size: auto`` gives the host's devices, split evenly.
AUTO_PINNED_SHARE = 1 / 16

_fn = os.path.join(os.path.dirname(__file__), "gpustreams.yaml")
with open(_fn) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


#: The keys of ``gpustreams.yaml``, the only ``gpustreams.*`` keys there are.
KEYS = tuple(defaults["gpustreams"])
_KNOWN = frozenset(KEYS)
#: Every spelling of a known key that dask reads as that key (``copy_streams`` too).
_SPELLINGS = _KNOWN | {k.replace("-", "_") for k in KEYS}
#: The unknown keys :func:`_warn_unknown_keys` warned of in this process.
_warned_keys: set[str] = set()

#: Largest ``gpustreams.streams``: the H200's (compute capability 9.0) 128 resident grids,
#: beyond which streams cannot run kernels at once (and the sim's one thread per stream).
MAX_STREAMS = 128
#: Largest ``gpustreams.copy-streams``: CUDA's maximum of ``CUDA_DEVICE_MAX_CONNECTIONS``.
MAX_COPY_STREAMS = 32
#: Largest ``gpustreams.block-size``.
MAX_BLOCK_SIZE = 100_000
#: Largest ``gpustreams.host-threads``.
MAX_HOST_THREADS = 64
#: Smallest byte size of ``pinned-pool-size`` and ``launch-ahead``.
MIN_SIZE = 1 << 20

_TRUE = frozenset({"true", "yes", "on", "1"})
_FALSE = frozenset({"false", "no", "off", "0"})
BOOL_ALLOWED = "True | False (or 'true'/'false', 'yes'/'no', 'on'/'off', 1/0)"
_PINNED = "'auto' or a byte size like '1 GiB' (>= 1 MiB)"
_AHEAD = "a byte size like '1 GiB' (>= 1 MiB)"
_SIZE_OR_OFF = "a byte size like '1 MiB', or 0 (off)"


def invalid_value(key: str, value: Any, allowed: str) -> ValueError:
    """The error of a bad ``gpustreams.<key>``: the key, the value and what is allowed."""
    return ValueError(f"gpustreams.{key}={value!r} is invalid: allowed values are {allowed}")


T = TypeVar("T")


class Registry(Generic[T]):
    """The values of one ``gpustreams.<key>`` that each name an entry (a backend, a policy).

    Entries are registered once, under their names, and found by name, in the
    order registered; ``extra`` values (``auto``) are valid without an entry.
    Every other value gets :func:`invalid_value`, listing the valid ones.
    """

    def __init__(self, key: str, extra: tuple[str, ...] = ()):
        self.key = key
        self.extra = extra
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        """Make ``entry`` the value of ``gpustreams.<key>: <name>``; returns it."""
        self._entries[name] = entry
        return entry

    def names(self) -> tuple[str, ...]:
        """The registered names, in the order registered (``extra`` left out)."""
        return tuple(self._entries)

    def entries(self) -> tuple[T, ...]:
        """The registered entries, in the order registered."""
        return tuple(self._entries.values())

    def allowed(self) -> str:
        """The valid values, for an error: ``"auto | cupy | sim"``."""
        return " | ".join((*self.extra, *self._entries))

    def get(self, name: str) -> T:
        """The entry registered as ``name``; ``ValueError`` naming the valid values if none is."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):  # TypeError: an unhashable value, such as ['sim']
            raise invalid_value(self.key, name, self.allowed()) from None

    def validate(self, name: str) -> None:
        """Raise :func:`invalid_value` unless ``name`` is registered or an ``extra`` value."""
        if name not in self.extra:
            self.get(name)


def parse_bool(key: str, value: Any) -> bool:
    """``gpustreams.<key>`` as a bool; every boolean key is read by this one parser.

    Accepts ``True``/``False``, the ints 0/1 and the strings (any case, spaces
    stripped) ``true``/``false``, ``yes``/``no``, ``on``/``off``, ``1``/``0``,
    as YAML and ``DASK_GPUSTREAMS__*`` variables give them. Raises
    ``ValueError`` naming the key for anything else.
    """
    if value is True or value is False:
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
    elif isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise invalid_value(key, value, BOOL_ALLOWED)


def _parse_int(key: str, value: Any, low: int, high: int) -> int:
    """``gpustreams.<key>`` as an int from ``low`` to ``high`` (bools and strings refused)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or not (low <= value <= high)
    ):
        raise invalid_value(key, value, f"an int >= {low} and <= {high}")
    return int(value)


def _parse_size(key: str, value: Any, allowed: str, low: int = MIN_SIZE) -> int:
    """``gpustreams.<key>`` as bytes >= ``low``: an int, or a string like ``'1 GiB'``."""
    size = value
    if isinstance(value, str):
        try:
            size = parse_bytes(value)
        except (ValueError, OverflowError):  # OverflowError: '1e400 B' is infinite
            size = None
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < low:
        raise invalid_value(key, value, allowed)  # the error names what was written
    return int(size)


def _section() -> Mapping:
    """Dask's ``gpustreams`` section; ``ValueError`` if it is not a mapping of keys.

    ``dask.config.set({"gpustreams": {"streams": 4}})`` replaces the whole section
    (dask does not merge a dict given to ``set``): the keys it leaves out keep their
    defaults when read (:meth:`StreamsConfig._read`).
    """
    section = dask.config.get("gpustreams", None)
    if not isinstance(section, Mapping):
        raise ValueError(
            f"gpustreams={section!r} is invalid: allowed values are a mapping of "
            f"gpustreams.* keys, such as {{'streams': 4}}"
        )
    return section


def _check_keys() -> None:
    """Raise ``ValueError`` for a ``gpustreams.*`` key that ``gpustreams.yaml`` does not have.

    Keys are compared as dask reads them (``copy_streams`` is ``copy-streams``; a key with
    both, which dask reads as neither, is unknown); the message suggests the closest known key.
    """
    section = _section()
    unknown = sorted(k for k in section if k not in _SPELLINGS)
    if unknown:
        raise ValueError(_unknown_key(section, unknown[0]))


def _unknown_key(section: Mapping, key: str) -> str:
    """What :func:`_check_keys` says of ``key``: its value, the closest known key, and all."""
    match = difflib.get_close_matches(key.replace("_", "-"), KEYS, n=1)
    hint = f" did you mean gpustreams.{match[0]}?" if match else ""
    known = ", ".join(f"gpustreams.{k}" for k in KEYS)
    written = f"gpustreams.{key}={section[key]!r}"
    return f"unknown configuration key {written};{hint} known keys: {known}"


def _warn_unknown_keys() -> None:
    """Warn of the ``gpustreams.*`` keys that ``gpustreams.yaml`` does not have, while off.

    While ``gpustreams.enabled`` is true they fail the compute (:func:`_check_keys`); while
    it is false nothing reads them, so a misspelt ``gpustreams.enable`` would leave the
    plugin off in silence. One set comparison a compute; each key is warned of once a
    process (:data:`_warned_keys`), whatever its value.
    """
    section = dask.config.config.get("gpustreams")
    if not isinstance(section, Mapping) or section.keys() <= _SPELLINGS:
        return
    for key in sorted(section.keys() - _SPELLINGS):
        if key not in _warned_keys:
            _warned_keys.add(key)
            message = f"{_unknown_key(section, key)}; gpustreams.enabled is off"
            warnings.warn(message, UserWarning, stacklevel=4)


@functools.lru_cache(maxsize=64)
def warn_once(message: str) -> None:
    """``UserWarning(message)``, once a process."""
    warnings.warn(message, UserWarning, stacklevel=2)


@dataclass(frozen=True)
class StreamsConfig:
    """Validated settings of one stream runtime.

    Values are normalized on construction (``timeline="on"`` is ``True``,
    ``pinned_pool_size="1 GiB"`` is ``1 << 30``), so equal settings compare equal.
    """

    backend: str = "auto"
    #: Compute streams per device, from 1 to :data:`MAX_STREAMS`.
    streams: int = 8
    policy: str = "auto"
    timeline: bool = False
    #: Copy streams per direction and device, from 1 to :data:`MAX_COPY_STREAMS`.
    copy_streams: int = 1
    #: Bytes, or ``'auto'``/None for :func:`auto_pinned_pool_size` (a size string is parsed).
    pinned_pool_size: int | str | None = None
    #: Bytes of launched task outputs the launcher keeps ahead of the device.
    launch_ahead: int | str = 192 << 20
    #: Threads that run the launcher's host tasks, from 1 to :data:`MAX_HOST_THREADS`: at
    #: most this many run at once, each holding its task's device memory meanwhile.
    host_threads: int = 2
    #: How the launcher ranks ready tasks: ``depth-first`` (:mod:`.runtime.ordering`: a
    #: walk from the outputs, under 5 us a key) or ``dask`` (``dask.order``, 6-22 us a key).
    launch_order: str = "depth-first"
    #: Allocations below this many bytes, made by the launcher's tasks, come from arenas
    #: of their own (``Backend.launch_allocator``); 0: off.
    small_blocks: int | str = 1 << 20
    #: The launcher's tasks of a group (key prefix) that has allocated a block of this many
    #: bytes are large (``TaskInfo.large``): ``auto`` runs them on 2 streams; 0: off.
    large_tasks: int | str = 16 << 20
    #: Allocations of at least this many bytes, made by the launcher's tasks, come from
    #: one arena of all the pool's streams, reused in stream order (``SharedBlocks``); 0: off.
    shared_blocks: int | str = 16 << 20
    #: One NVTX range per task (Nsight Systems); see :mod:`dask_gpustreams.diagnostics.nvtx`.
    nvtx: bool = False
    #: Stream blocks on distributed: ``auto`` groups GPU chains into one task each, ``off``
    #: not (YAML reads a bare ``off`` as False, which means ``off`` too).
    blocks: str = "auto"
    #: The most values (inputs from outside, outputs) a stream block holds until it ends; a
    #: group that holds more is cut into blocks of at most this many tasks (and at most
    #: ``MAX_BLOCK_TASKS``, 4,096). From 2 to :data:`MAX_BLOCK_SIZE`.
    block_size: int = 64

    def __post_init__(self) -> None:
        from dask_gpustreams.backends.registry import BACKENDS
        from dask_gpustreams.runtime.policies.base import POLICIES

        BACKENDS.validate(self.backend)
        POLICIES.validate(self.policy)
        if self.blocks is False:
            object.__setattr__(self, "blocks", "off")
        if self.blocks not in BLOCKS:
            raise invalid_value("blocks", self.blocks, " | ".join(BLOCKS))
        if self.launch_order not in LAUNCH_ORDERS:
            raise invalid_value("launch-order", self.launch_order, " | ".join(LAUNCH_ORDERS))
        size = self.pinned_pool_size
        auto = size is None or (isinstance(size, str) and size.strip().lower() == "auto")
        normalized = {
            "streams": _parse_int("streams", self.streams, 1, MAX_STREAMS),
            "copy_streams": _parse_int("copy-streams", self.copy_streams, 1, MAX_COPY_STREAMS),
            "block_size": _parse_int("block-size", self.block_size, 2, MAX_BLOCK_SIZE),
            "host_threads": _parse_int("host-threads", self.host_threads, 1, MAX_HOST_THREADS),
            "pinned_pool_size": None if auto else _parse_size("pinned-pool-size", size, _PINNED),
            "launch_ahead": _parse_size("launch-ahead", self.launch_ahead, _AHEAD),
            "small_blocks": _parse_size("small-blocks", self.small_blocks, _SIZE_OR_OFF, 0),
            "large_tasks": _parse_size("large-tasks", self.large_tasks, _SIZE_OR_OFF, 0),
            "shared_blocks": _parse_size("shared-blocks", self.shared_blocks, _SIZE_OR_OFF, 0),
        }
        for name in _BOOL_FIELDS:
            normalized[name] = parse_bool(name.replace("_", "-"), getattr(self, name))
        for name, value in normalized.items():
            object.__setattr__(self, name, value)

    @classmethod
    def from_dask_config(cls, **overrides: Any) -> StreamsConfig:
        """Read ``gpustreams.*`` from dask's config; keyword arguments take precedence.

        Raises ``ValueError`` for a bad value and for an unknown ``gpustreams.*`` key.
        Every local compute reads it: settings already read are not parsed again (a
        snapshot of the section is the key), which costs tens of microseconds a compute.
        """
        overridden = {k: v for k, v in overrides.items() if v is not None}
        # With the types: 8.0 and True equal 8 and 1 but are not read alike.
        snapshot = tuple((k, type(v), v) for k, v in _section().items())
        key = (snapshot, tuple(overridden.items()))
        try:
            hash(key)
        except TypeError:  # an unhashable value somewhere: read the long way
            return cls._read(overridden)
        return _config_of(cls, *key)  # a TypeError of the read itself is raised once

    @classmethod
    def _read(cls, overrides: dict[str, Any]) -> StreamsConfig:
        """:meth:`from_dask_config` without its cache."""
        _check_keys()
        values = {**cls._given(), **overrides}
        if values["pinned_pool_size"] is None:  # YAML null: 'auto' is spelt out there
            raise invalid_value("pinned-pool-size", None, _PINNED)
        return cls(**values)

    @classmethod
    def _given(cls) -> dict[str, Any]:
        """Each field's ``gpustreams.*`` value in dask's config, as given (unparsed)."""
        section = defaults["gpustreams"]  # for keys a replaced section left out
        return {
            field: dask.config.get(f"gpustreams.{key}", section[key])
            for field in cls.__dataclass_fields__
            for key in [field.replace("_", "-")]
        }

    @classmethod
    def changed_settings(cls) -> dict[str, Any]:
        """The settings of dask's config that differ from ``gpustreams.yaml``'s defaults,
        as given (``'auto'`` stays ``'auto'``), by field name: the keyword arguments of
        ``StreamsPlugin`` that carry a client's settings to workers that read another
        config. Compared as read: a default spelt otherwise (``'false'``, ``0``, ``'AUTO'``,
        ``'192MiB'``) is no change, and leaves the workers' own config as it is; a bad value
        is one (``StreamsPlugin`` raises its error)."""
        section = defaults["gpustreams"]
        changed = {}
        for field, value in cls._given().items():
            default = section[field.replace("_", "-")]
            if value == default and type(value) is type(default):
                continue  # as gpustreams.yaml gives it: no parse
            try:
                parsed, read = cls(**{field: value}), cls(**{field: default})
                same = getattr(parsed, field) == getattr(read, field)
            except (ValueError, TypeError):
                same = False
            if not same:
                changed[field] = value
        return changed


@functools.lru_cache(maxsize=32)
def _config_of(cls: type[StreamsConfig], snapshot: tuple, overrides: tuple) -> StreamsConfig:
    """The settings read from a ``gpustreams`` section whose ``(key, type, value)`` items
    are ``snapshot``."""
    return cls._read(dict(overrides))


#: The boolean fields of :class:`StreamsConfig`, read by :func:`parse_bool`.
_BOOL_FIELDS = tuple(f.name for f in fields(StreamsConfig) if f.type == "bool")


#: Hard memory limits of the process's cgroup (v2, then v1), read where present.
_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory() -> int:
    """Bytes of host memory this process may use: total RAM, or its cgroup limit if lower."""
    import psutil

    limit = psutil.virtual_memory().total
    for path in _CGROUP_LIMITS:
        try:
            with open(path) as f:
                value = f.read().strip()
        except OSError:
            continue
        if value.isdigit():
            limit = min(limit, int(value))
    return limit


def auto_pinned_pool_size(devices: int) -> int:
    """``pinned-pool-size: auto``: :data:`AUTO_PINNED_SHARE` of host memory per device.

    ``devices`` are the host's devices, so that one process per GPU
    (dask-cuda workers) stays within the share as a whole.
    """
    return max(1 << 20, int(host_memory() * AUTO_PINNED_SHARE) // max(1, devices))


def enabled() -> bool:
    """Whether ``gpustreams.enabled`` is true, read by :func:`parse_bool` (once per compute).

    While it is false, an unknown ``gpustreams.*`` key is warned of (:func:`_warn_unknown_keys`).
    """
    value = dask.config.get("gpustreams.enabled", False)
    if value is not True and (value is False or not parse_bool("enabled", value)):
        _warn_unknown_keys()
        return False
    return True
