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
    pinned_pool_size: int = 1 << 30

    def __post_init__(self) -> None:
        from dask_gpustreams.runtime.policies import policy_names

        if self.backend not in BACKENDS:
            raise _bad_value("backend", self.backend, " | ".join(BACKENDS))
        if self.policy not in policy_names():
            raise _bad_value("policy", self.policy, " | ".join(policy_names()))
        if not isinstance(self.timeline, bool):
            raise _bad_value("timeline", self.timeline, "True | False")
        size = "a byte size like '1 GiB' (>= 1 MiB)"
        for field, key, minimum, allowed in [
            ("streams", "streams", 1, "an int >= 1"),
            ("copy_streams", "copy-streams", 1, "an int >= 1"),
            ("pinned_pool_size", "pinned-pool-size", 1 << 20, size),
        ]:
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
        size = values["pinned_pool_size"]
        if isinstance(size, str):
            try:
                values["pinned_pool_size"] = parse_bytes(size)
            except ValueError:
                raise _bad_value(
                    "pinned-pool-size", size, "a byte size like '1 GiB' (>= 1 MiB)"
                ) from None
        return cls(**values)


def enabled() -> bool:
    """Whether ``gpustreams.enabled`` is set (strings like ``"true"`` accepted, as from YAML)."""
    value = dask.config.get("gpustreams.enabled", False)
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
