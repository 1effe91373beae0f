"""What the launcher learns about task groups that block the host, and what it logs."""

from __future__ import annotations

import functools
import logging
import re

import pytest

from dask_gpustreams import host_task
from dask_gpustreams.markers import is_host_task
from dask_gpustreams.runtime.hosttasks import HostTasks


def test_a_group_flips_at_info_once_then_at_debug(caplog):
    """A GPU group slow only now and then (a cold pool's allocations) goes back and forth;
    its first verdicts are logged at INFO, the later ones at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="dask_gpustreams.runtime.hosttasks")
    learned = HostTasks()
    slow, fast = 2 * learned.threshold_s, learned.threshold_s / 10
    for _ in range(2):
        for _ in range(learned.confirm):
            learned.observe("fill", slow)
        assert "fill" in learned
        for _ in range(learned.recover):
            learned.observe("fill", fast)
        assert "fill" not in learned
    levels = [(r.levelname, r.getMessage().split(":")[1].strip()) for r in caplog.records]
    assert levels == [
        ("INFO", "tasks of group 'fill' block the host (2 calls in a row, the last took 10.0 ms)"),
        ("INFO", "tasks of group 'fill' no longer block the host (2 fast calls)"),
        ("DEBUG", "tasks of group 'fill' block the host (2 calls in a row, the last took 10.0 ms)"),
        ("DEBUG", "tasks of group 'fill' no longer block the host (2 fast calls)"),
    ]


def test_a_group_is_marked_after_two_slow_calls_in_a_row_and_kept_while_slow_calls_come():
    learned = HostTasks()
    slow, fast = 2 * learned.threshold_s, learned.threshold_s / 10
    learned.observe("sleeper", fast)
    assert not learned
    learned.observe("sleeper", slow)
    assert (learned.groups(), learned.suspecting()) == ([], True)
    learned.observe("sleeper", slow)
    assert (learned.groups(), learned.suspecting()) == (["sleeper"], False)
    for _ in range(3):  # fast, slow, fast...: never recover fast calls in a row
        learned.observe("sleeper", fast)
        learned.observe("sleeper", slow)
    assert learned.groups() == ["sleeper"]


def test_a_slow_call_between_fast_ones_marks_nothing():
    """A GPU group slow once (a cudaMalloc that waited for the device, a collection) stays
    on the launcher: its next fast call clears the suspicion, whatever other groups do."""
    learned = HostTasks()
    slow, fast = 2 * learned.threshold_s, learned.threshold_s / 10
    for _ in range(3):
        learned.observe("fill", slow)
        learned.observe("other", fast)
        assert learned.suspecting()
        learned.observe("fill", fast)
        assert not learned.suspecting()
    assert learned.groups() == []


def test_the_oldest_suspicion_is_dropped_beyond_max_suspects():
    """Groups slow once that never run again do not pile up: past ``max_suspects`` the
    oldest is forgotten, so its next slow call counts as its first."""
    learned = HostTasks()
    learned.max_suspects = 4
    slow = 2 * learned.threshold_s
    learned.observe("first", slow)
    for i in range(learned.max_suspects):
        learned.observe(("other", i), slow)
    learned.observe("first", slow)
    assert learned.groups() == []
    learned.observe("first", slow)
    assert learned.groups() == ["first"]


@pytest.mark.parametrize("fn", [len, "a".upper], ids=["builtin", "bound-method"])
def test_host_task_on_what_takes_no_attribute_is_a_type_error_naming_it(fn):
    with pytest.raises(TypeError, match="^" + re.escape(f"host_task cannot mark {fn!r}: ")):
        host_task(fn)


def _on_host(x, scale=1):
    return x * scale


def _on_device(x, scale=1):
    return x * scale


host_task(_on_host)


def nested_partial(fn, *args, **kwargs):
    """``partial(partial(fn), ...)``, kept nested: ``partial`` flattens a partial of a
    partial unless the inner one has attributes of its own (a label here)."""
    inner = functools.partial(fn)
    inner.label = "inner"
    outer = functools.partial(inner, *args, **kwargs)
    assert outer.func is inner
    return outer


@pytest.mark.parametrize(
    ("fn", "marked"),
    [
        (_on_host, True),
        (functools.partial(_on_host, scale=2), True),
        (nested_partial(_on_host, scale=2), True),
        (nested_partial(nested_partial(_on_host, 2)), True),
        (host_task(functools.partial(_on_device)), True),  # the partial's own mark
        (functools.partial(host_task(functools.partial(_on_device))), True),
        (_on_device, False),
        (functools.partial(_on_device, scale=2), False),
        (nested_partial(nested_partial(_on_device)), False),
        (len, False),
    ],
    ids=[
        "marked",
        "partial",
        "partial-of-partial",
        "three-deep",
        "marked-partial",
        "partial-of-marked-partial",
        "unmarked",
        "unmarked-partial",
        "unmarked-three-deep",
        "builtin",
    ],
)
def test_a_partial_of_a_host_task_is_one(fn, marked):
    """The mark is found through ``functools.partial`` at any depth: the partial calls it."""
    assert is_host_task(fn) is marked
