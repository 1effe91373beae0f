"""The ``gpustreams`` configuration: defaults, switching on, and the errors of bad values."""

from __future__ import annotations

import logging
import textwrap

import dask
import pytest
from dask import delayed

from dask_gpustreams import StreamsConfig
from dask_gpustreams.backends import gpu_visible, resolve_backend
from dask_gpustreams.config import enabled
from dask_gpustreams.integrations.local import hook
from dask_gpustreams.runtime import get_runtime, live_runtimes


def test_defaults_are_registered_with_dask():
    assert dask.config.get("gpustreams.enabled") is False
    assert dask.config.get("gpustreams.backend") == "auto"
    assert dask.config.get("gpustreams.streams") == 8
    assert dask.config.get("gpustreams.policy") == "auto"
    assert dask.config.get("gpustreams.timeline") is False
    assert enabled() is False


def test_dataclass_defaults_match_the_yaml():
    assert StreamsConfig.from_dask_config() == StreamsConfig()


def test_from_dask_config_reads_set_values_and_overrides():
    with dask.config.set({"gpustreams.streams": 3, "gpustreams.policy": "least-loaded"}):
        config = StreamsConfig.from_dask_config(backend="sim", policy=None)
    assert (config.backend, config.streams, config.policy) == ("sim", 3, "least-loaded")


def test_every_read_sees_the_settings_of_its_moment():
    """Settings read once are not parsed again, but a change, an equal value of another
    type, or an unhashable value is read anew, and a bad value fails every time."""
    reads = []
    for value in (3, 4, 3, 3.0, 3, [3], 3.0):
        with dask.config.set({"gpustreams.streams": value}):
            try:
                reads.append(StreamsConfig.from_dask_config().streams)
            except ValueError as e:
                reads.append(str(e).split(" is invalid")[0])
    bad = "gpustreams.streams=3.0"
    assert reads == [3, 4, 3, bad, 3, "gpustreams.streams=[3]", bad]
    with dask.config.set({"gpustreams.streams": 5, "gpustreams.policy": "round-robin"}):
        assert StreamsConfig.from_dask_config(policy="least-loaded").policy == "least-loaded"
        assert StreamsConfig.from_dask_config().policy == "round-robin"
    with dask.config.set({"gpustreams.nonsense": 1}), pytest.raises(ValueError, match="nonsense"):
        StreamsConfig.from_dask_config()


@pytest.mark.parametrize(
    "value, expected",
    [(True, True), (False, False), ("true", True), ("True", True), (" on ", True), ("1", True)]
    + [("false", False), ("0", False), ("no", False), (1, True), (0, False), ("YES", True)],
)
def test_enabled_accepts_bools_and_yaml_strings(value, expected):
    with dask.config.set({"gpustreams.enabled": value}):
        assert enabled() is expected


# --- invalid values --------------------------------------------------------------------------

STREAMS = r"allowed values are an int >= 1 and <= 128$"
COPY_STREAMS = r"allowed values are an int >= 1 and <= 32$"
HOST_THREADS = r"allowed values are an int >= 1 and <= 64$"
BOOL = r"allowed values are True \| False \(or 'true'/'false', 'yes'/'no', 'on'/'off', 1/0\)$"
SIZE = r"allowed values are a byte size like '1 GiB' \(>= 1 MiB\)$"

INVALID = [
    ("streams", 0, rf"gpustreams\.streams=0 is invalid: {STREAMS}"),
    ("streams", -1, rf"gpustreams\.streams=-1 is invalid: {STREAMS}"),
    ("streams", 2.5, rf"gpustreams\.streams=2\.5 is invalid: {STREAMS}"),
    ("streams", "4", rf"gpustreams\.streams='4' is invalid: {STREAMS}"),
    ("streams", True, rf"gpustreams\.streams=True is invalid: {STREAMS}"),
    ("streams", 129, rf"gpustreams\.streams=129 is invalid: {STREAMS}"),
    ("streams", 10**6, rf"gpustreams\.streams=1000000 is invalid: {STREAMS}"),
    ("copy_streams", 33, rf"gpustreams\.copy-streams=33 is invalid: {COPY_STREAMS}"),
    ("copy_streams", 0, rf"gpustreams\.copy-streams=0 is invalid: {COPY_STREAMS}"),
    ("host_threads", 0, rf"gpustreams\.host-threads=0 is invalid: {HOST_THREADS}"),
    ("host_threads", 65, rf"gpustreams\.host-threads=65 is invalid: {HOST_THREADS}"),
    ("host_threads", "2", rf"gpustreams\.host-threads='2' is invalid: {HOST_THREADS}"),
    ("timeline", "maybe", rf"gpustreams\.timeline='maybe' is invalid: {BOOL}"),
    ("timeline", 2, rf"gpustreams\.timeline=2 is invalid: {BOOL}"),
    (
        "pinned_pool_size",
        "1e400 B",
        r"gpustreams\.pinned-pool-size='1e400 B' is invalid: allowed values are 'auto' or a byte",
    ),
    ("launch_ahead", "1e400 B", rf"gpustreams\.launch-ahead='1e400 B' is invalid: {SIZE}"),
    ("launch_ahead", "lots", rf"gpustreams\.launch-ahead='lots' is invalid: {SIZE}"),
    ("launch_ahead", "512 KiB", rf"gpustreams\.launch-ahead='512 KiB' is invalid: {SIZE}"),
    ("launch_ahead", 1 << 19, rf"gpustreams\.launch-ahead=524288 is invalid: {SIZE}"),
    (
        "small_blocks",
        "lots",
        r"gpustreams\.small-blocks='lots' is invalid: allowed values are a byte size like "
        r"'1 MiB', or 0 \(off\)",
    ),
    ("small_blocks", -1, r"gpustreams\.small-blocks=-1 is invalid: allowed values are a byte"),
    (
        "policy",
        "fastest",
        r"gpustreams\.policy='fastest' is invalid: allowed values are .*round-robin",
    ),
    (
        "backend",
        "gpu",
        r"gpustreams\.backend='gpu' is invalid: allowed values are auto \| cupy \| sim$",
    ),
]
INVALID_IDS = [f"{name}={value!r}" for name, value, _ in INVALID]


@pytest.mark.parametrize("name, value, message", INVALID, ids=INVALID_IDS)
def test_invalid_value_is_rejected_by_the_config(name, value, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        StreamsConfig(**{name: value})


@pytest.mark.parametrize("name, value, message", INVALID, ids=INVALID_IDS)
def test_invalid_value_fails_compute_before_any_task_runs(gpustreams, name, value, message):
    ran = []
    with gpustreams(streams=2), dask.config.set({f"gpustreams.{name}": value}):  # noqa: SIM117
        with pytest.raises(ValueError, match=f"^{message}"):
            delayed(ran.append)(1).compute()
    assert ran == []
    assert live_runtimes() == []
    assert hook._runs == {}


needs_no_gpu = pytest.mark.skipif(gpu_visible()[0], reason="a GPU is visible here")


@needs_no_gpu
def test_cupy_backend_without_a_gpu_fails_compute_with_the_reason(gpustreams):
    ran = []
    message = (
        r"^gpustreams\.backend='cupy' cannot start: CuPy (is not installed|sees no device)"
        r".*; allowed values are auto \| cupy \| sim"
    )
    with gpustreams(), dask.config.set({"gpustreams.backend": "cupy"}):  # noqa: SIM117
        with pytest.raises(ValueError, match=message):
            delayed(ran.append)(1).compute()
    assert ran == []
    assert live_runtimes() == []


@needs_no_gpu
def test_auto_backend_without_a_gpu_uses_the_sim_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="dask_gpustreams"):
        assert resolve_backend("auto") == "sim"
        rt = get_runtime(StreamsConfig(backend="auto", streams=2))
    assert rt.backend.name == "sim"
    assert "using the simulated stream device (gpustreams.backend='sim')" in caplog.text


def test_resolve_backend_passes_sim_through():
    assert resolve_backend("sim") == "sim"


# --- environment -----------------------------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import dask
    from dask import delayed
    import dask_gpustreams
    from dask_gpustreams import sim
    from dask_gpustreams.runtime import runtime

    def probe():
        return sim.get_device().current_stream() is not sim.get_device().default_stream

    on_pool = delayed(probe, pure=False)().compute()
    print(dask.config.get("gpustreams.enabled"), dask.config.get("gpustreams.streams"),
          on_pool, [r.pool.n_streams for r in runtime.live_runtimes()])
    """
)


def test_enabled_through_environment_variables(run_python):
    env = {
        "DASK_GPUSTREAMS__ENABLED": "True",
        "DASK_GPUSTREAMS__BACKEND": "sim",
        "DASK_GPUSTREAMS__STREAMS": "3",
    }
    assert run_python(PROBE, env).split() == ["True", "3", "True", "[3]"]


def test_disabled_by_default_in_a_fresh_process(run_python):
    assert run_python(PROBE).split() == ["False", "8", "False", "[]"]


def test_invalid_environment_value_fails_compute(run_python):
    code = textwrap.dedent(
        """
        from dask import delayed
        import dask_gpustreams
        try:
            delayed(len)([1]).compute()
        except ValueError as e:
            print(e)
        """
    )
    env = {"DASK_GPUSTREAMS__ENABLED": "True", "DASK_GPUSTREAMS__STREAMS": "0"}
    out = run_python(code, env)
    assert (
        out.strip() == "gpustreams.streams=0 is invalid: allowed values are an int >= 1 and <= 128"
    )
