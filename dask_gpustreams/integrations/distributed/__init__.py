"""The ``distributed`` integration: :class:`StreamsPlugin`, a worker plugin (see :mod:`.plugin`).

One module per part of the plugin, after the sections of its documentation:

- :mod:`.plugin`: :class:`StreamsPlugin`, its lifecycle and ``transition`` hook;
- :mod:`.execution`: the run_spec of each task that starts executing (*Execution*);
- :mod:`.egress`: the waits of ``get_data`` and spilling (*Egress*);
- :mod:`.provenance`: the events and taints of keys, the release of corrupt results
  (*Failures*);
- :mod:`.failures`: the records of corrupt results, which their recomputation raises.
"""

from dask_gpustreams.integrations.distributed.plugin import StreamsPlugin as StreamsPlugin
