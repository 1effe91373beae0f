"""One-off probes: each answered a question of a past session; its docstring says which.

They are kept to rerun that question on a new machine or commit, not as benchmarks: they
print text, check their results where they compute any, and are not part of
``python -m benchmarks run``. A probe that patches a library method restores it when it ends
(``unittest.mock.patch.object``).

- ``probe_host``: where a threaded-scheduler run loses time against the hand launch
  (``python -m benchmarks.probes.probe_host``);
- ``probe_copy``: the copy pipeline's chunks against Dask's final concatenation
  (``python -m benchmarks.probes.probe_copy``);
- ``probe_exit``: how long a process takes to exit after a compute with the plugin on
  (tests/gpu did not exit on the H200; ``python -m benchmarks.probes.probe_exit``).
- ``probe_block_plans``: which graphs of the suite and wide shapes get other stream blocks
  than at another commit (``python -m benchmarks.probes.probe_block_plans --against REV``).

The diagnostics still run at each GPU session stay at the top of ``benchmarks/``:
``probe_distributed`` (``--hook-times`` in ``h200_cluster.sh``) and ``probe_diagnostics``.
"""
