"""A screenshot of the scheduler's ``gpustreams`` dashboard page during a busy run, on the sim.

Starts a ``LocalCluster`` of two workers with the plugin on the simulated device
(4 streams each, timeline on), keeps them busy with chains of kernels of 30 to
150 ms, opens ``/gpustreams`` in headless Chromium and saves the page as a PNG::

    apt-get install chromium   # Debian's package; or pass --chromium PATH
    python -m benchmarks.screenshot_dashboard [--out docs/dashboard.png] [--page-seconds 8]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request

import dask
from distributed import Client, LocalCluster

from dask_gpustreams import sim

CONFIG = {
    "gpustreams.enabled": True,
    "gpustreams.backend": "sim",
    "gpustreams.streams": 4,
    "gpustreams.timeline": True,
}


def _sleep_add(out, a, seconds):
    time.sleep(seconds)
    out[...] = a + 1


def kernel(a, ms):
    """``a + 1`` by a simulated kernel that runs ``ms`` milliseconds."""
    out = sim.empty(a.shape)
    sim.launch(_sleep_add, out, a, ms / 1e3)
    return out


def start(n):
    return sim.asarray([float(n)])


def busy(client: Client, stop: threading.Event) -> None:
    """Waves of 16 independent chains of 4 kernels (five key prefixes), until ``stop`` is set."""
    rng = random.Random(0)
    names = ("stencil", "fft", "gemm", "reduce", "scale")
    wave = 0
    while not stop.is_set():
        chains = []
        for i in range(16):
            x = dask.delayed(start)(i, dask_key_name=f"upload-{wave}-{i}")
            for j in range(4):
                key = f"{rng.choice(names)}-{wave}-{i}-{j}"
                x = dask.delayed(kernel)(x, rng.uniform(30, 150), dask_key_name=key)
            chains.append(x)
        client.gather(client.compute(chains))
        wave += 1


def screenshot(chromium: str, url: str, seconds: float) -> bytes:
    """A PNG of ``url`` in headless Chromium, ``seconds`` after it opened (DevTools protocol).

    Chromium's own ``--screenshot`` shoots at the load event, before Bokeh's
    websocket has delivered the page's document, so it shows an empty page.
    """
    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                "--window-size=1400,700",
                "--remote-debugging-port=0",
                "--remote-allow-origins=*",
                f"--user-data-dir={profile}",
                url,
            ],
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            port = None
            for line in browser.stderr:
                if line.startswith("DevTools listening on ws://"):
                    port = int(line.split(":")[2].split("/")[0])
                    break
            if port is None:
                raise RuntimeError(f"{chromium} exited ({browser.wait()}) before it listened")
            time.sleep(seconds)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as response:
                pages = [t for t in json.load(response) if t["type"] == "page"]
            return asyncio.run(_capture(pages[0]["webSocketDebuggerUrl"]))
        finally:
            browser.terminate()
            browser.wait()


async def _capture(target: str) -> bytes:
    from tornado.websocket import websocket_connect

    connection = await websocket_connect(target, max_message_size=64 * 2**20)
    request = {"id": 1, "method": "Page.captureScreenshot", "params": {"format": "png"}}
    await connection.write_message(json.dumps(request))
    while True:
        message = json.loads(await connection.read_message())
        if message.get("id") == 1:
            connection.close()
            return base64.b64decode(message["result"]["data"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--seconds", type=float, default=4.0, help="of run before the page opens")
    parser.add_argument("--page-seconds", type=float, default=8.0, help="the page is open")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "chromium")
    args = parser.parse_args()

    with (
        dask.config.set(CONFIG),
        LocalCluster(n_workers=2, threads_per_worker=4, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        stop = threading.Event()
        load = threading.Thread(target=busy, args=(client, stop), daemon=True)
        load.start()
        time.sleep(args.seconds)
        url = cluster.dashboard_link.replace("/status", "/gpustreams")
        png = screenshot(args.chromium, url, args.page_seconds)
        stop.set()
        load.join()
    with open(args.out, "wb") as f:
        f.write(png)
    print(f"wrote {args.out} from {url}")


if __name__ == "__main__":
    main()
