"""Every bad ``gpustreams.*`` value or key is refused with a clear error (issue 12).

Booleans through one parser, bounds of the stream counts, byte sizes that
overflow, unknown keys, registering ``StreamsPlugin`` again, and the cluster
routes: where a bad setting cannot raise, a warning at ``Client(...)`` or the
failure of every task of the workers concerned (``tests/test_distributed_cli.py``
has the command-line routes).
"""

from __future__ import annotations

import re
import textwrap
import warnings
from dataclasses import fields

import dask
import pytest
from dask import delayed
from distributed import Client, LocalCluster

from dask_gpustreams import StreamsConfig, StreamsPlugin, config, dask_setup, sim, status
from dask_gpustreams.config import KEYS, MAX_COPY_STREAMS, MAX_STREAMS, enabled, parse_bool
from dask_gpustreams.runtime import live_runtimes
from dask_gpustreams.runtime.policies import policy_names
from tests.sim_tasks import ones

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


@pytest.mark.parametrize("value", ["maybe", "", None])
def test_invalid_enabled_fails_a_compute_on_the_launcher_by_name(gpustreams, value):
    ran = []
    with gpustreams(), dask.config.set({"gpustreams.enabled": value}):  # noqa: SIM117
        with pytest.raises(ValueError, match=bool_error("enabled", value)):
            delayed(ran.append)(1).compute(scheduler="gpustreams")
    assert ran == []


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


# --- names found in a registry ------------------------------------------------------------------


@pytest.mark.parametrize("key", ["backend", "policy"])
def test_a_name_not_registered_gets_the_one_invalid_value_message(key):
    from dask_gpustreams.backends import backend_entry
    from dask_gpustreams.runtime.policies import make_policy

    find = {"backend": backend_entry, "policy": make_policy}[key]
    allowed = {"backend": "auto | cupy | sim", "policy": " | ".join(policy_names())}[key]
    message = f"gpustreams.{key}='nope' is invalid: allowed values are {allowed}"
    for make in (lambda: find("nope"), lambda: StreamsConfig(**{key: "nope"})):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            make()


@pytest.mark.parametrize("key", ["backend", "policy"])
def test_an_unhashable_name_is_a_value_error_naming_the_key(key, gpustreams):
    message = "^" + re.escape(f"gpustreams.{key}=['sim'] is invalid: allowed values are ")
    with pytest.raises(ValueError, match=message):
        StreamsConfig(**{key: ["sim"]})
    with pytest.raises(ValueError, match=message):
        StreamsPlugin(**{key: ["sim"]})
    with gpustreams(**{key: ["sim"]}), pytest.raises(ValueError, match=message):
        delayed(len)([1]).compute()


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


def test_small_blocks_large_tasks_and_shared_blocks_are_a_size_or_zero():
    default = StreamsConfig()
    assert (default.small_blocks, default.large_tasks, default.shared_blocks) == (
        1 << 20,
        16 << 20,
        16 << 20,
    )
    assert StreamsConfig(small_blocks="64 KiB").small_blocks == 64 << 10
    assert StreamsConfig(large_tasks="1 GiB").large_tasks == 1 << 30
    assert StreamsConfig(shared_blocks="4 MiB").shared_blocks == 4 << 20
    assert StreamsConfig(small_blocks=0, large_tasks=0, shared_blocks=0) == StreamsConfig(
        small_blocks="0 B", large_tasks="0 B", shared_blocks="0 B"
    )
    with pytest.raises(ValueError, match=r"gpustreams\.large-tasks='big' is invalid"):
        StreamsConfig(large_tasks="big")
    with pytest.raises(ValueError, match=r"gpustreams\.shared-blocks=-1 is invalid: allowed"):
        StreamsConfig(shared_blocks=-1)


def test_launch_order_is_dask_or_depth_first_and_a_compute_names_a_bad_one(gpustreams):
    assert StreamsConfig().launch_order == "depth-first"
    assert StreamsConfig(launch_order="dask").launch_order == "dask"
    message = (
        "gpustreams.launch-order='breadth-first' is invalid: allowed values are dask | depth-first"
    )
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        StreamsConfig(launch_order="breadth-first")
    with (
        gpustreams(**{"launch-order": "breadth-first"}),
        pytest.raises(ValueError, match="^" + re.escape(message) + "$"),
    ):
        delayed(len)([1]).compute(scheduler="gpustreams")


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


def test_a_section_set_as_a_dict_keeps_the_defaults_of_the_keys_it_leaves_out():
    # dask.config.set replaces a section given as a dict: it does not merge it.
    with dask.config.set({"gpustreams": {"enabled": True, "backend": "sim", "streams": 2}}):
        config = StreamsConfig.from_dask_config()
        assert (config.backend, config.streams) == ("sim", 2)
        assert config.launch_ahead == StreamsConfig().launch_ahead
        assert "error" not in str(status())
        assert sim.asnumpy(delayed(ones)(3).sum().compute()).tolist() == 3.0


@pytest.mark.parametrize("section", [None, 1, "on"], ids=repr)
def test_a_section_that_is_not_a_mapping_is_a_value_error_naming_it(section):
    message = f"gpustreams={section!r} is invalid: allowed values are a mapping"
    with dask.config.set({"gpustreams": section}):
        with pytest.raises(ValueError, match="^" + re.escape(message)):
            StreamsConfig.from_dask_config()
        assert message in str(status())


def test_an_unknown_key_fails_compute_before_any_task_runs(gpustreams):
    ran = []
    with gpustreams(streams=2), dask.config.set({"gpustreams.stream": 4}):  # noqa: SIM117
        with pytest.raises(ValueError, match=r"^unknown configuration key gpustreams\.stream=4"):
            delayed(ran.append)(1).compute()
    assert ran == []
    assert live_runtimes() == []


def test_an_unknown_key_is_warned_of_while_off_once_a_process(monkeypatch):
    """While off nothing reads the section, so ``gpustreams.enable`` would leave the plugin
    off in silence: the compute runs as plain Dask and warns, once a key whatever its
    value, with the closest key. ``scheduler="gpustreams"`` raises it instead, unwarned."""
    monkeypatch.setattr(config, "_warned_keys", set())
    message = (
        "unknown configuration key gpustreams.enable=True; did you mean gpustreams.enabled? "
        f"known keys: {KNOWN}; gpustreams.enabled is off"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dask.config.set({"gpustreams.enable": True}):
            assert delayed(sum)([1, 2]).compute() == 3
            assert delayed(sum)([3, 4]).compute(scheduler="sync") == 7
        with dask.config.set({"gpustreams.enable": "yes", "gpustreams.stream": 4}):
            with pytest.raises(ValueError, match=r"^unknown configuration key gpustreams\.en"):
                delayed(sum)([1, 2]).compute(scheduler="gpustreams")
            assert len(caught) == 1  # raised, not warned of
            assert delayed(sum)([5, 6]).compute() == 11
    assert [str(w.message) for w in caught] == [
        message,
        message.replace(
            "enable=True; did you mean gpustreams.enabled?",
            "stream=4; did you mean gpustreams.streams?",
        ),
    ]
    assert live_runtimes() == []


def test_a_key_spelt_with_both_dashes_and_underscores_in_a_section_is_unknown():
    """Dask reads ``pinned_pool_size`` as ``pinned-pool-size``, but not ``pinned_pool-size``
    in a section given whole (``dask.config.set`` maps it only as a dotted key)."""
    with dask.config.set({"gpustreams": {"pinned_pool-size": "1 GiB"}}):  # noqa: SIM117
        with pytest.raises(ValueError, match=r"^unknown configuration key gpustreams\.pinned_pool"):
            StreamsConfig.from_dask_config()


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
        first = client.submit(on_pool_stream, pure=False)
        assert first.result()
        assert list(client.run(plugin_streams).values()) == [(4, 4)]

        client.register_plugin(StreamsPlugin(streams=2))
        # A new plugin, whose runtime starts at its setup: a result is in memory, made while
        # no plugin was set up as far as it knows (Provenance.note_unpooled).
        assert list(client.run(plugin_streams).values()) == [(2, 2)]
        del first
        assert client.submit(on_pool_stream, pure=False).result()
        assert list(client.run(plugin_streams).values()) == [(2, 2)]

        # A client created with gpustreams.enabled does not undo the registered settings.
        with dask.config.set({"gpustreams.enabled": True}), Client(cluster) as other:
            assert other.submit(on_pool_stream, pure=False).result()
        assert list(client.run(plugin_streams).values()) == [(2, 2)]


# --- the cluster routes -----------------------------------------------------------------------

SIM = {"gpustreams.backend": "sim", "distributed.worker.memory.spill": False}
STREAMS_ABC = "gpustreams.streams='abc' is invalid: allowed values are an int >= 1 and <= 128"


def has_plugin(dask_worker):
    return "gpustreams" in dask_worker.plugins


def local_cluster(**kwargs):
    return LocalCluster(n_workers=1, threads_per_worker=1, dashboard_address=":0", **kwargs)


@pytest.mark.parametrize(
    "config, error",
    [
        ({"gpustreams.streams": "abc"}, STREAMS_ABC),
        ({"gpustreams.enabled": "maybe"}, "gpustreams.enabled='maybe' is invalid: allowed "),
    ],
    ids=["bad-value", "bad-enabled"],
)
def test_a_bad_setting_before_the_client_is_a_warning_at_client(config, error):
    message = f"gpustreams is not installed by this client: {error}"
    with dask.config.set(SIM), local_cluster(processes=False) as cluster:  # noqa: SIM117
        with (
            dask.config.set({"gpustreams.enabled": True, **config}),
            pytest.warns(UserWarning, match="^" + re.escape(message)),
            Client(cluster) as client,
        ):
            assert list(client.run(has_plugin).values()) == [False]  # nothing registered


def test_a_worker_refusing_the_clients_plugin_is_named_in_a_warning_and_fails_its_tasks():
    with dask.config.set({**SIM, "gpustreams.stream": 4}):  # the worker process's config
        cluster = local_cluster(processes=True)
    with cluster, dask.config.set({"gpustreams.enabled": True}):
        [worker] = cluster.scheduler_info["workers"]
        message = (
            f"gpustreams cannot start on worker {worker}: unknown configuration key "
            "gpustreams.stream=4; did you mean gpustreams.streams? known keys: "
        )
        with pytest.warns(UserWarning, match="^" + re.escape(message)):
            client = Client(cluster)
        with client:
            for _ in range(2):
                with pytest.raises(ValueError, match="^" + re.escape(message)):
                    client.submit(on_pool_stream, pure=False).result()


def test_a_worker_refusing_a_registered_plugin_fails_every_task_until_replaced():
    with dask.config.set(SIM), local_cluster(processes=False) as cluster, Client(cluster) as client:
        plugin = StreamsPlugin(streams=2)  # checked against this process's config
        [worker] = cluster.scheduler_info["workers"]
        policies = " | ".join(policy_names())
        message = (
            f"gpustreams cannot start on worker {worker}: gpustreams.policy='nope' is invalid: "
            f"allowed values are {policies}"
        )
        with (
            dask.config.set({"gpustreams.policy": "nope"}),  # the worker's config, later
            pytest.raises(ValueError, match="^" + re.escape(message) + "$"),
        ):
            client.register_plugin(plugin)
        [row] = status(client).rows
        assert row["error"] == message
        for _ in range(2):
            with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
                client.submit(on_pool_stream, pure=False).result()
        client.register_plugin(StreamsPlugin(streams=2))  # the config is fixed: it replaces it
        assert client.submit(on_pool_stream, pure=False).result()
        assert list(client.run(plugin_streams).values()) == [(2, 2)]


def test_worker_preload_arguments_set_the_plugin():
    argv = ["--streams", "2", "--no-timeline", "--create-cuda-context"]  # dask-cuda's: ignored
    with (
        dask.config.set(SIM),
        local_cluster(processes=False, preload=["dask_gpustreams"], preload_argv=argv) as c,
        Client(c) as client,
    ):
        assert client.submit(on_pool_stream, pure=False).result()
        assert list(client.run(plugin_streams).values()) == [(2, 2)]


@pytest.mark.parametrize("value, written", [("0", "0"), ("abc", "'abc'")], ids=["0", "abc"])
def test_a_bad_worker_preload_argument_fails_the_tasks_naming_the_allowed_values(value, written):
    argv = ["--streams", value]
    with (
        dask.config.set(SIM),
        local_cluster(processes=False, preload=["dask_gpustreams"], preload_argv=argv) as c,
        Client(c) as client,
    ):
        [worker] = c.scheduler_info["workers"]
        message = (
            f"gpustreams cannot start on worker {worker}: preload argument: Invalid value for "
            f"'--streams': gpustreams.streams={written} is invalid: allowed values are an int "
            ">= 1 and <= 128"
        )
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            client.submit(on_pool_stream, pure=False).result()


def test_a_bad_scheduler_preload_argument_fails_the_tasks_of_every_worker():
    scheduler = {"preload": ["dask_gpustreams"], "preload_argv": ["--policy", "nope"]}
    with (
        dask.config.set(SIM),
        LocalCluster(n_workers=2, processes=False, dashboard_address=":0",
                     scheduler_kwargs=scheduler) as c,
        Client(c) as client,
    ):  # fmt: skip
        for worker in c.scheduler_info["workers"]:
            message = (
                f"gpustreams cannot start on worker {worker}: the scheduler's preload argument: "
                "Invalid value for '--policy': gpustreams.policy='nope' is invalid: allowed "
            )
            future = client.submit(on_pool_stream, workers=[worker], pure=False)
            with pytest.raises(ValueError, match="^" + re.escape(message)):
                future.result()


@pytest.mark.filterwarnings("ignore:gpustreams cannot start on worker:UserWarning")
@pytest.mark.parametrize("route", ["scheduler preload", "gpustreams.enabled"])
def test_a_workers_own_preload_options_outlast_the_plugin_that_a_preload_registers(route):
    # Registering with the scheduler replaces the worker's plugin by the one the scheduler's
    # preload (or the client's gpustreams.enabled) registered: the worker keeps its options.
    config = {**SIM, "gpustreams.enabled": route == "gpustreams.enabled"}
    scheduler = {"preload": ["dask_gpustreams"], "preload_argv": ["--streams", "3"]}
    for argv, error in [(["--streams", "2"], None), (["--stream", "2"], "No such option")]:
        with (
            dask.config.set(config),
            local_cluster(
                processes=False,
                preload=["dask_gpustreams"],
                preload_argv=argv,
                scheduler_kwargs=scheduler if route == "scheduler preload" else {},
            ) as c,
            Client(c) as client,
        ):
            if error is None:
                assert client.submit(on_pool_stream, pure=False).result()
                assert list(client.run(plugin_streams).values()) == [(2, 2)]
            else:
                with pytest.raises(ValueError, match="preload argument: " + error):
                    client.submit(on_pool_stream, pure=False).result()


@pytest.mark.filterwarnings("ignore:gpustreams cannot start on worker:UserWarning")
@pytest.mark.parametrize(
    "scheduler_argv",
    [None, ["--streams", "3"], ["--policy", "nope"]],
    ids=["worker", "and-scheduler", "and-a-bad-scheduler-option"],
)
def test_the_preload_error_a_worker_keeps_does_not_hold_the_worker(scheduler_argv):
    # PRELOADED keeps a worker's own preload error, keyed weakly by the worker. Raised as it
    # is, the error's traceback would hold setup's frame, so the worker: the entry would keep
    # its own key, and the closed worker and its memory, for as long as the process. Where
    # the scheduler's preload is bad too, the worker's own error, the more specific, is raised.
    from dask_gpustreams.integrations.distributed.plugin import PRELOADED

    scheduler = {"preload": ["dask_gpustreams"], "preload_argv": scheduler_argv}
    with (
        dask.config.set(SIM),
        local_cluster(
            processes=False,
            preload=["dask_gpustreams"],
            preload_argv=["--stream", "2"],
            scheduler_kwargs=scheduler if scheduler_argv else {},
        ) as c,
        Client(c) as client,
    ):
        with pytest.raises(ValueError, match="preload argument: No such option '--stream'"):
            client.submit(on_pool_stream, pure=False).result()
        (worker,) = c.workers.values()
        _, error = PRELOADED[worker]
        assert "No such option" in str(error)
        assert error.__traceback__ is None


def test_the_preload_options_are_the_config_keys():
    shown = [p for p in dask_setup.params if not p.hidden]
    assert [p.opts for p in shown] == [[f"--{k}"] for k in KEYS if k != "enabled"]
    flags = {p.opts[0]: p.secondary_opts for p in shown if p.secondary_opts}
    assert flags == {"--timeline": ["--no-timeline"], "--nvtx": ["--no-nvtx"]}


def test_a_setup_that_fails_otherwise_fails_the_tasks_and_leaves_the_worker_as_it_was():
    """Not only bad settings: any setup error fails the tasks (distributed only logs it)."""
    from unittest import mock

    from dask_gpustreams.integrations.distributed.egress import Egress

    real_install = Egress.install

    def install(self):
        real_install(self)  # done, and then a failure
        raise OSError("no spill buffers")

    with (
        dask.config.set(SIM),
        mock.patch.object(Egress, "install", install),
        local_cluster(processes=False, preload=["dask_gpustreams"]) as cluster,
        Client(cluster) as client,
    ):
        [worker] = cluster.scheduler_info["workers"]
        message = f"gpustreams cannot start on worker {worker}: OSError('no spill buffers')"
        for _ in range(2):
            with pytest.raises(RuntimeError, match="^" + re.escape(message) + "$"):
                client.submit(on_pool_stream, pure=False).result()
        [row] = status(client).rows
        assert row["error"] == message
        [w] = cluster.workers.values()
        assert w.handlers["get_data"] == w.get_data  # the worker's own handler, restored


@pytest.mark.parametrize(
    "key, value",
    [
        ("timeline", "false"),  # DASK_GPUSTREAMS__TIMELINE=false: dask keeps the string
        ("timeline", 0),
        ("pinned-pool-size", "AUTO"),
        ("launch-ahead", "192MiB"),
        ("launch-ahead", 192 << 20),
        ("blocks", "auto"),
    ],
)
def test_a_default_spelt_otherwise_is_no_changed_setting(key, value):
    """A client's changed settings override the workers' own config (the client preload
    carries them): one that reads as the default must leave the workers' config alone."""
    with dask.config.set({f"gpustreams.{key}": value}):
        assert StreamsConfig.changed_settings() == {}


@pytest.mark.parametrize(
    "key, value",
    [("streams", 4), ("blocks", False), ("timeline", "on"), ("copy_streams", 2), ("streams", 8.0)],
)
def test_a_changed_setting_is_carried_as_given(key, value):
    with dask.config.set({f"gpustreams.{key}": value}):
        assert StreamsConfig.changed_settings() == {key.replace("-", "_"): value}


def test_a_closed_worker_whose_plugin_had_bad_settings_is_let_go():
    """A plugin with bad settings raises its error from setup, so the error's traceback
    holds setup's frame, and the worker. Nothing of the plugin's may keep that plugin
    after the worker closed (``LATEST`` is keyed weakly by the worker: a value that holds
    its key would keep the closed worker, and its memory, for as long as the process)."""
    import gc
    import logging
    import weakref

    from tests.conftest import forget_closed_servers

    # distributed's log of the failed setup (its exc_info) would hold the worker too.
    quiet = logging.getLogger("distributed.worker")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with dask.config.set(SIM), local_cluster(processes=False) as c, Client(c) as client:
            (worker,) = c.workers.values()
            closed = weakref.ref(worker)
            del worker
            with pytest.raises(ValueError, match="gpustreams cannot start on worker"):
                client.register_plugin(StreamsPlugin.failing(ValueError("bad")))
    finally:
        quiet.setLevel(level)
    forget_closed_servers()
    gc.collect()
    assert closed() is None
