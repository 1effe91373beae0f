"""Every bad ``gpustreams.*`` value or key is refused with a clear error (issue 12).

Booleans through one parser, bounds of the stream counts, byte sizes that
overflow, unknown keys, and registering ``StreamsPlugin`` again.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import fields

import dask
import pytest
from dask import delayed
from distributed import Client, LocalCluster

from dask_gpustreams import StreamsConfig, StreamsPlugin, sim
from dask_gpustreams.config import KEYS, MAX_COPY_STREAMS, MAX_STREAMS, enabled, parse_bool
from dask_gpustreams.runtime import live_runtimes

BOOL = "True | False (or 'true'/'false', 'yes'/'no', 'on'/'off', 1/0)"
TRUE = [True, 1, "true", "TRUE", " yes ", "On", "1"]
FALSE = [False, 0, "false", "No", "off ", "0"]
NOT_BOOL = ["maybe", "flase", "", " ", "2", 2, -1, 1.0, [], None, {}]


def bool_error(key: str, value: object) -> str:
    return "^" + re.escape(f"gpustreams.{key}={value!r} is invalid: allowed values are {BOOL}")


# --- booleans: one parser for every boolean key ---------------------------------------------


@pytest.mark.parametrize("value", TRUE + FALSE, ids=repr)
def test_enabled_and_timeline_accept_the_same_values(value):
    expected = value in TRUE
    assert parse_bool("enabled", value) is expected
    with dask.config.set({"gpustreams.enabled": value}):
        assert enabled() is expected
    assert StreamsConfig(timeline=value).timeline is expected
    assert StreamsConfig(timeline=value) == StreamsConfig(timeline=expected)


@pytest.mark.parametrize("value", NOT_BOOL, ids=repr)
def test_enabled_refuses_anything_else_naming_the_key(value):
    with dask.config.set({"gpustreams.enabled": value}):  # noqa: SIM117
        with pytest.raises(ValueError, match=bool_error("enabled", value)):
            enabled()


@pytest.mark.parametrize("value", NOT_BOOL, ids=repr)
def test_timeline_refuses_anything_else_naming_the_key(value):
    with pytest.raises(ValueError, match=bool_error("timeline", value)):
        StreamsConfig(timeline=value)


def test_timeline_yes_from_the_config_is_on(gpustreams):
    with gpustreams(streams=2, timeline="yes"):
        assert StreamsConfig.from_dask_config().timeline is True


def test_invalid_enabled_fails_compute(gpustreams):
    ran = []
    with gpustreams(), dask.config.set({"gpustreams.enabled": "maybe"}):  # noqa: SIM117
        with pytest.raises(ValueError, match=bool_error("enabled", "maybe")):
            delayed(ran.append)(1).compute()
    assert ran == []
    assert live_runtimes() == []


COMPUTE = textwrap.dedent(
    """
    from dask import delayed
    import dask_gpustreams
    try:
        print(delayed(len)([1]).compute())
    except ValueError as e:
        print(e)
    """
)


@pytest.mark.parametrize("value", ["maybe", "flase", ""])
def test_invalid_enabled_through_the_environment_fails_compute(run_python, value):
    out = run_python(
        COMPUTE, {"DASK_GPUSTREAMS__ENABLED": value, "DASK_GPUSTREAMS__BACKEND": "sim"}
    )
    assert out.rstrip("\n") == f"gpustreams.enabled={value!r} is invalid: allowed values are {BOOL}"


# --- stream counts: documented maximums -------------------------------------------------------


def test_stream_counts_up_to_their_maximums_are_accepted():
    assert (MAX_STREAMS, MAX_COPY_STREAMS) == (128, 32)
    config = StreamsConfig(streams=MAX_STREAMS, copy_streams=MAX_COPY_STREAMS)
    assert (config.streams, config.copy_streams) == (128, 32)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"streams": 10**6}, "gpustreams.streams=1000000 is invalid: allowed values are an int"),
        ({"streams": 129}, "gpustreams.streams=129 is invalid: allowed values are an int"),
        ({"copy_streams": 33}, "gpustreams.copy-streams=33 is invalid: allowed values are an int"),
    ],
)
def test_the_plugin_refuses_too_many_streams_on_the_client(overrides, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        StreamsPlugin(**overrides)


def test_too_many_streams_fail_compute_naming_the_key(gpustreams):
    with gpustreams(streams=10**6), pytest.raises(ValueError, match=r"^gpustreams\.streams="):
        delayed(len)([1]).compute()
    assert live_runtimes() == []


# --- byte sizes that overflow -----------------------------------------------------------------


@pytest.mark.parametrize("key", ["pinned-pool-size", "launch-ahead"])
@pytest.mark.parametrize("value", ["1e400 B", "1e400 GiB", "inf B", "nan B"])
def test_byte_sizes_that_overflow_are_a_value_error_naming_the_key(key, value):
    message = "^" + re.escape(f"gpustreams.{key}={value!r} is invalid: allowed values are ")
    with dask.config.set({f"gpustreams.{key}": value}):  # noqa: SIM117
        with pytest.raises(ValueError, match=message):
            StreamsConfig.from_dask_config()


def test_launch_ahead_strings_are_parsed():
    assert StreamsConfig(launch_ahead="64 MiB").launch_ahead == 64 << 20
    assert StreamsConfig(launch_ahead="1 MiB") == StreamsConfig(launch_ahead=1 << 20)


# --- unknown keys -----------------------------------------------------------------------------

KNOWN = ", ".join(f"gpustreams.{k}" for k in KEYS)


def test_the_known_keys_are_the_yaml_keys():
    assert KEYS[:3] == ("enabled", "backend", "streams")
    fields_ = {f.name.replace("_", "-") for f in fields(StreamsConfig)}
    assert set(KEYS) == {"enabled"} | fields_


def test_an_unknown_key_is_refused_with_the_closest_known_one():
    message = (
        "unknown configuration key gpustreams.stream=4; did you mean gpustreams.streams? "
        f"known keys: {KNOWN}"
    )
    with dask.config.set({"gpustreams.stream": 4}):  # noqa: SIM117
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            StreamsConfig.from_dask_config()


@pytest.mark.parametrize(
    "key, match",
    [
        ("copy_stream", "copy-streams"),
        ("pinned-pool", "pinned-pool-size"),
        ("timelines", "timeline"),
    ]
    + [("enable", "enabled"), ("launch_ahaed", "launch-ahead")],
)
def test_underscores_and_dashes_are_one_spelling_in_suggestions(key, match):
    with dask.config.set({f"gpustreams.{key}": 1}):  # noqa: SIM117
        with pytest.raises(ValueError, match=rf"; did you mean gpustreams\.{match}\? known keys"):
            StreamsConfig.from_dask_config()


def test_an_unknown_key_without_a_close_one_lists_the_known_keys():
    message = f"unknown configuration key gpustreams.xyzzy='a'; known keys: {KNOWN}"
    with dask.config.set({"gpustreams.xyzzy": "a"}):  # noqa: SIM117
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            StreamsConfig.from_dask_config()


def test_keys_spelt_with_underscores_are_known():
    section = {k.replace("-", "_"): v for k, v in dask.config.get("gpustreams").items()}
    section["copy_streams"] = 2
    with dask.config.set({"gpustreams": section}):
        assert StreamsConfig.from_dask_config().copy_streams == 2


def test_an_unknown_key_fails_compute_before_any_task_runs(gpustreams):
    ran = []
    with gpustreams(streams=2), dask.config.set({"gpustreams.stream": 4}):  # noqa: SIM117
        with pytest.raises(ValueError, match=r"^unknown configuration key gpustreams\.stream=4"):
            delayed(ran.append)(1).compute()
    assert ran == []
    assert live_runtimes() == []


def test_an_unknown_key_in_the_environment_fails_compute(run_python):
    env = {
        "DASK_GPUSTREAMS__ENABLED": "True",
        "DASK_GPUSTREAMS__BACKEND": "sim",
        "DASK_GPUSTREAMS__STREAM": "4",
    }
    out = run_python(COMPUTE, env)
    assert out.startswith("unknown configuration key gpustreams.stream=4; did you mean")


def test_an_unknown_key_fails_the_plugin_on_the_client():
    with dask.config.set({"gpustreams.stream": 4}):  # noqa: SIM117
        with pytest.raises(ValueError, match=r"^unknown configuration key gpustreams\.stream=4"):
            StreamsPlugin(streams=2)


# --- registering the plugin again -------------------------------------------------------------


def plugin_streams(dask_worker):
    """(configured streams, streams of the worker's runtime) of its plugin."""
    plugin = dask_worker.plugins["gpustreams"]
    return plugin.config.streams, plugin.runtime and plugin.runtime.pool.n_streams


def on_pool_stream():
    device = sim.get_device()
    return device.current_stream() is not device.default_stream


def test_registering_the_plugin_again_applies_the_new_settings():
    config = {"gpustreams.backend": "sim", "distributed.worker.memory.spill": False}
    with (
        dask.config.set(config),
        LocalCluster(processes=False, n_workers=1, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        client.register_plugin(StreamsPlugin(streams=4))
        assert client.submit(on_pool_stream, pure=False).result()
        assert list(client.run(plugin_streams).values()) == [(4, 4)]

        client.register_plugin(StreamsPlugin(streams=2))
        assert list(client.run(plugin_streams).values()) == [(2, None)]  # a new plugin
        assert client.submit(on_pool_stream, pure=False).result()
        assert list(client.run(plugin_streams).values()) == [(2, 2)]

        # A client created with gpustreams.enabled does not undo the registered settings.
        with dask.config.set({"gpustreams.enabled": True}), Client(cluster) as other:
            assert other.submit(on_pool_stream, pure=False).result()
        assert list(client.run(plugin_streams).values()) == [(2, 2)]
