"""A ``gpustreams`` page on the scheduler's dashboard: device time per worker and stream, live.

:func:`add_dashboard_page` adds it at ``/gpustreams`` (listed in ``/sitemap.json``
and in the navigation bar); the plugin's scheduler part
(:class:`~dask_gpustreams.integrations.distributed.erred_inputs.ErredInputs`)
calls it when the first worker with the plugin connects, so every route that
installs the plugin gets the page. Without Bokeh, or on a scheduler without a
dashboard, it does nothing. Only this package's :mod:`.page` imports Bokeh.

How distributed builds its dashboard: ``distributed.dashboard.scheduler.connect``
makes one ``BokehTornado`` of the ``applications`` dict when the scheduler
starts, and adds it to ``scheduler.http_application``, a ``RoutingApplication``
that tries each of its applications in turn. A page added later is one more
such application, made by the same helper (``distributed.dashboard.core.
BokehApplication``, with the scheduler's template variables, so it has the
navigation bar); ``"gpustreams"`` is appended to the template's ``pages``
(the navigation links of every page rendered from then on). Distributed stops
it with its own at close.

The page polls the workers (:mod:`.feed`) only while it is open, and has them
record timing events meanwhile; see :mod:`.feed` for what is missed.
"""

from __future__ import annotations

import logging
from typing import Any

from dask_gpustreams.diagnostics.dashboard.feed import (
    TimelineFeed,
    WorkerFeed,
    busy_fraction,
    install_worker_feed,
    timeline_feed,
)

logger = logging.getLogger("dask_gpustreams")

#: The page's path on the dashboard.
ROUTE = "/gpustreams"

__all__ = [
    "ROUTE",
    "TimelineFeed",
    "WorkerFeed",
    "add_dashboard_page",
    "busy_fraction",
    "install_worker_feed",
    "timeline_feed",
]


def add_dashboard_page(scheduler: Any) -> bool:
    """Add the ``gpustreams`` page to ``scheduler``'s dashboard; True if it is there.

    Idempotent. Call it on the scheduler's event loop (a ``SchedulerPlugin.start``,
    a scheduler preload, ``client.run_on_scheduler``). Returns False, changing
    nothing, without Bokeh (``pip install 'dask-gpustreams[dashboard]'``) or
    without a dashboard; errors are logged, never raised.
    """
    try:
        from bokeh.server.tornado import BokehTornado
    except ImportError:
        return False
    http = getattr(scheduler, "http_application", None)
    dashboards = [a for a in getattr(http, "applications", ()) if isinstance(a, BokehTornado)]
    if not dashboards:
        return False
    if any(ROUTE in a.app_paths for a in dashboards):
        return True
    try:
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
        from tornado.ioloop import IOLoop

        from dask_gpustreams.diagnostics.dashboard.page import timeline_doc

        variables = template_variables(scheduler)  # memoized: the dict of every page
        prefix = getattr(dashboards[0], "_prefix", "")  # the scheduler's http_prefix
        app = BokehApplication(
            {ROUTE: timeline_doc}, scheduler, prefix=prefix, template_variables=variables
        )
        http.add_application(app)
        app.initialize(IOLoop.current())
        app.start()
        if ROUTE.strip("/") not in variables["pages"]:
            variables["pages"].append(ROUTE.strip("/"))
        _repair_sitemap(http)
    except Exception:
        logger.warning("gpustreams: could not add the dashboard page %s", ROUTE, exc_info=True)
        return False
    return True


def _repair_sitemap(http: Any) -> None:
    """Make ``/sitemap.json`` list the Bokeh pages instead of failing (distributed 2026.8.0).

    distributed's ``DirectoryHandler`` recognizes a Bokeh application by
    ``"bokeh" in str(app)``, which no longer holds for its own
    ``DaskBokehTornado`` (bokeh >= 3.3); it then walks that application's
    routes and fails (HTTP 500) on Bokeh's ``StaticHandler``, which has no
    ``path``. The sitemap's rule gets a subclass that tells Bokeh applications
    by type; other applications are walked as before.
    """
    from bokeh.server.tornado import BokehTornado
    from distributed.http import routing

    if all("bokeh" in str(a) for a in http.applications if isinstance(a, BokehTornado)):
        return  # distributed's test holds

    class SitemapHandler(routing.DirectoryHandler):
        def get(self) -> None:
            out: set[str] = set()
            routers: set = set()
            for app in [*self.application.applications, self.application]:
                if isinstance(app, BokehTornado):
                    out.update(app.app_paths)
                else:
                    routing._descend_routes(app.default_router, routers, out)
                    routing._descend_routes(app.wildcard_router, routers, out)
            self.write({"paths": sorted(out)})

    def rules(router: Any):
        for rule in getattr(router, "rules", ()):
            yield rule
            yield from rules(rule.target)

    for rule in rules(http.default_router):
        if rule.target is routing.DirectoryHandler:
            rule.target = SitemapHandler
