"""The ``gpustreams`` section of dask's configuration: defaults and validation.

Defaults live in ``gpustreams.yaml`` beside this file and are registered with
``dask.config.update_defaults`` at import, so ``DASK_GPUSTREAMS__ENABLED=True``
and ``dask.config.set({"gpustreams.streams": 4})`` work as for any dask key.
Values are validated by :meth:`StreamsConfig.from_dask_config` when a runtime
starts, so a bad value fails the ``compute`` call, not a task deep in a graph.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes

BACKENDS = ("auto", "cupy", "sim")

#: Share of the host's memory (or of its cgroup limit, if lower) that
#: ``pinned-pool-size: auto`` gives the host's devices, split evenly.
AUTO_PINNED_SHARE = 1 / 16

_fn = os.path.join(os.path.dirname(__file__), "gpustreams.yaml")
with open(_fn) as f:
    defaults = yaml.safe_load(f)

dask.config.update_defaults(defaults)


def _bad_value(key: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"gpustreams.{key}={value!r} is invalid: allowed values are {allowed}")


@dataclass(frozen=True)
class StreamsConfig:
    """Validated settings of one stream runtime."""

    backend: str = "auto"
    streams: int = 8
    policy: str = "auto"
    timeline: bool = False
    copy_streams: int = 1
    #: Bytes, or ``'auto'``/None for :func:`auto_pinned_pool_size` (a size string is parsed).
    pinned_pool_size: int | str | None = None
    #: Bytes of launched task outputs the launcher keeps ahead of the device.
    launch_ahead: int | str = 1 << 30

    def __post_init__(self) -> None:
        from dask_gpustreams.runtime.policies import policy_names

        size = self.pinned_pool_size
        if isinstance(size, str):
            if size.strip().lower() == "auto":
                size = None
            else:
                try:
                    size = parse_bytes(size)
                except ValueError:
                    size = None
                if size is None or size < 1 << 20:  # the error names what was written
                    raise _bad_value("pinned-pool-size", self.pinned_pool_size, _PINNED_ALLOWED)
            object.__setattr__(self, "pinned_pool_size", size)
        if isinstance(self.launch_ahead, str):
            try:
                ahead = parse_bytes(self.launch_ahead)
            except ValueError:
                raise _bad_value("launch-ahead", self.launch_ahead, _AHEAD_ALLOWED) from None
            object.__setattr__(self, "launch_ahead", ahead)

        if self.backend not in BACKENDS:
            raise _bad_value("backend", self.backend, " | ".join(BACKENDS))
        if self.policy not in policy_names():
            raise _bad_value("policy", self.policy, " | ".join(policy_names()))
        if not isinstance(self.timeline, bool):
            raise _bad_value("timeline", self.timeline, "True | False")
        checks = [
            ("streams", "streams", 1, "an int >= 1"),
            ("copy_streams", "copy-streams", 1, "an int >= 1"),
            ("launch_ahead", "launch-ahead", 1 << 20, _AHEAD_ALLOWED),
        ]
        if self.pinned_pool_size is not None:
            checks.append(("pinned_pool_size", "pinned-pool-size", 1 << 20, _PINNED_ALLOWED))
        for field, key, minimum, allowed in checks:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise _bad_value(key, value, allowed)
            if value < minimum:
                raise _bad_value(key, value, allowed)
            object.__setattr__(self, field, int(value))

    @classmethod
    def from_dask_config(cls, **overrides: Any) -> StreamsConfig:
        """Read ``gpustreams.*`` from dask's config; keyword arguments take precedence."""
        values = {
            field: dask.config.get(f"gpustreams.{field.replace('_', '-')}")
            for field in cls.__dataclass_fields__
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        if values["pinned_pool_size"] is None:  # YAML null: 'auto' is spelt out there
            raise _bad_value("pinned-pool-size", None, _PINNED_ALLOWED)
        return cls(**values)


_PINNED_ALLOWED = "'auto' or a byte size like '1 GiB' (>= 1 MiB)"
_AHEAD_ALLOWED = "a byte size like '1 GiB' (>= 1 MiB)"


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
    """Whether ``gpustreams.enabled`` is set (strings like ``"true"`` accepted, as from YAML)."""
    value = dask.config.get("gpustreams.enabled", False)
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
