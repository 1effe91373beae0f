"""Run Dask task graphs on pools of GPU streams, ordered by device-side events.

Switch on with ``dask.config.set({"gpustreams.enabled": True})``: local computes
on Dask's threaded scheduler, by default or by name, then run on the stream
launcher (one thread enqueues the whole graph; also ``scheduler="gpustreams"``),
Dask's threads asked for as such (a ``pool`` of the user's, ``num_workers`` above 1
passed to the compute or from 2 to ``gpustreams.host-threads`` in Dask's config, or
``dask.threaded.get`` passed as the scheduler) run each task through the runtime
(``num_workers=1`` runs on the launcher, every task on the calling thread), and
distributed workers take the plugin.
"""

import dask.base

from dask_gpustreams import config as config  # registers the gpustreams.* defaults
from dask_gpustreams import sim as sim
from dask_gpustreams.config import StreamsConfig as StreamsConfig
from dask_gpustreams.diagnostics import timeline as timeline
from dask_gpustreams.diagnostics.status import status as status
from dask_gpustreams.errors import KernelError as KernelError
from dask_gpustreams.integrations.distributed import StreamsPlugin as StreamsPlugin
from dask_gpustreams.integrations.distributed.gathered import install as _install_gathered
from dask_gpustreams.integrations.distributed.tracebacks import install as _install_tracebacks
from dask_gpustreams.integrations.launcher import SCHEDULER_NAME as _SCHEDULER_NAME
from dask_gpustreams.integrations.launcher import get as get
from dask_gpustreams.integrations.local import install as _install_local_route
from dask_gpustreams.integrations.preload import dask_setup as dask_setup
from dask_gpustreams.markers import host_task as host_task
from dask_gpustreams.runtime import get_runtime as get_runtime
from dask_gpustreams.transfers import to_device as to_device
from dask_gpustreams.transfers import to_host as to_host

_install_local_route()
_install_tracebacks()
_install_gathered()
dask.base.named_schedulers[_SCHEDULER_NAME] = get

__version__ = "0.1.0"
