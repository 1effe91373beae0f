"""The tests of dask's CuPy modules that cannot apply to the sim, and why (no side effects).

Read by ``sim_cupy_plugin`` (which skips them with these reasons) and by
``tests/test_dask_array_suite.py`` (which checks that each is skipped, no more).
"""

from __future__ import annotations

_IS_CUPY_TYPE = (
    "dask recognizes CuPy arrays by 'cupy' in their type's name (dask.utils.is_cupy_type), "
    "and SimArray's is dask_gpustreams.sim._array.SimArray"
)
_TOKEN = (
    "SimArray tokenizes by identity (queued kernels may still write its buffer), CuPy arrays "
    "by their pickled bytes: two graphs built from one device array get different keys"
)

#: "module::test" (or "module::test[" for every parameter) -> why it cannot apply to the sim.
INAPPLICABLE: dict[str, str] = {
    "test_cupy_core.py::test_asanyarray[like1-arr3]": (
        f"{_IS_CUPY_TYPE}, so asanyarray_safe converts the dask array through NumPy"
    ),
    "test_cupy_core.py::test_view_fortran": "SimArray buffers are C-ordered only (asfortranarray)",
    "test_cupy_creation.py::test_diagonal": (
        f"{_IS_CUPY_TYPE}, so an empty diagonal's chunks are made by NumPy"
    ),
    "test_cupy_linalg.py::test_lstsq[": (
        f"{_IS_CUPY_TYPE}, so solve_triangular takes scipy.linalg (not cupyx.scipy), which is "
        "not installed and would not take SimArrays"
    ),
    "test_cupy_percentile.py::test_percentile_tokenize": _TOKEN,
    "test_cupy_routines.py::test_bincount": f"{_TOKEN} (same_keys)",
    "test_cupy_reductions.py::test_nanarg_reductions[": (
        "the sim's kernel is NumPy's nanargmin/nanargmax, which raises on an all-NaN slice "
        "(a KernelError at the next sync); CuPy's kernel returns, and dask's aggregate raises "
        "the ValueError the test expects"
    ),
}

#: The prefix of each skip reason, as pytest reports it.
PREFIX = "not on the sim: "


def reason(module: str, name: str) -> str | None:
    """Why test ``name`` (with its parameters) of ``module`` (a file name) is skipped, or None."""
    for pattern, why in INAPPLICABLE.items():
        listed_module, listed = pattern.split("::")
        if listed_module == module and (
            name == listed or (listed.endswith("[") and name.startswith(listed))
        ):
            return why
    return None
