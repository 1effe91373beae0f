"""The ``distributed`` integration: :class:`StreamsPlugin`, a worker plugin (see :mod:`.plugin`).

One module per part of the plugin, each the owner of its state:

- :mod:`.plugin`: :class:`StreamsPlugin`, its lifecycle and ``transition`` hook, which
  compose the parts and call their methods;
- :mod:`.provenance`: :class:`.Provenance`, the worker's device state (its runtime, the
  events and taints of keys, the corrupt keys held for their dependents) and the release
  of corrupt results (*Failures*);
- :mod:`.failures`: the records of corrupt results, which their recomputation raises;
- :mod:`.execution`: the run_spec of each task that starts executing (*Execution*);
- :mod:`.egress`: the waits of ``get_data`` and spilling (*Egress*);
- :mod:`.withheld`: what stays of a removed plugin while corrupt keys it found are held;
- :mod:`.serialize`: the simulated device's arrays over distributed's serializer, as
  CuPy's (registered on import);
- :mod:`.gathered`: values a task gets from a client inside its worker, ordered and held
  (installed on import)."""

from dask_gpustreams.integrations.distributed import serialize as serialize
from dask_gpustreams.integrations.distributed.plugin import StreamsPlugin as StreamsPlugin
