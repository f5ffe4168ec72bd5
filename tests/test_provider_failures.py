"""Provider failures reach the user: tasks only a disabled node type could run fail with the
provider's own message; a launch call that hangs is bounded and never blocks shutdown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import tidepool
from tidepool.errors import ConnectionLostError, ProviderError
from tidepool.providers.base import LaunchRequest
from tidepool.providers.callback import CallbackProvider
from tidepool.scaling.node_types import NodeType

pytestmark = pytest.mark.integration


def inc(x: int) -> int:
    return x + 1


def test_launches_that_raise_fail_the_waiting_tasks_with_the_providers_message() -> None:
    calls: list[str] = []

    def launch(req: LaunchRequest) -> None:
        calls.append(req.request_id)
        raise RuntimeError("quota exceeded for instance family g5 (code 403)")

    provider = CallbackProvider(launch, lambda ids: None)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        scaler = cluster.adapt(node_types=[NodeType("gpu", {"cpu": 1, "gpu": 1}, max_nodes=2, startup_estimate=0.2)],
                               provider=provider, max_type_failures=3, backoff_base=0.05)  # fmt: skip
        fut = client.submit(inc, 1, resources={"gpu": 1}, key="train")
        with pytest.raises(ProviderError, match="quota exceeded") as info:
            fut.result(timeout=60)
        assert "code 403" in str(info.value) and "gpu" in str(info.value)
        # each failed launch counted once (the callback both raised and reported it)
        assert scaler.view.failures["gpu"] == len(calls) == 3
        kinds = [r["kind"] for r in scaler.journal.records]
        assert kinds.count("launch-failed") == 3 and "node-type-disabled" in kinds
        # new work for the disabled type fails at once, with the same reason
        with pytest.raises(ProviderError, match="quota exceeded"):
            client.submit(inc, 2, resources={"gpu": 1}).result(timeout=30)


def test_workers_that_never_register_disable_their_type_and_fail_its_tasks() -> None:
    procs: list[subprocess.Popen[bytes]] = []

    def launch(req: LaunchRequest) -> None:
        env = {**os.environ, **req.env, "TIDEPOOL_TOKEN": "not-the-token"}
        for cmd in req.commands:  # they start, fail the handshake, and exit
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    provider = CallbackProvider(launch, lambda ids: None)
    try:
        with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
            cluster.adapt(node_types=[NodeType("cpu", {"cpu": 1}, max_nodes=1, startup_estimate=0.2)],
                          provider=provider, max_type_failures=2, backoff_base=0.05, launch_timeout=2.0)  # fmt: skip
            fut = client.submit(inc, 1)
            with pytest.raises(ProviderError, match="did not register") as info:
                fut.result(timeout=60)
            assert "disabled" in str(info.value)
    finally:
        for p in procs:
            p.kill()
            p.wait()


HANGING_LAUNCH = textwrap.dedent("""
    import threading, time, tidepool
    from tidepool.errors import ProviderError
    from tidepool.providers.callback import CallbackProvider
    from tidepool.scaling.node_types import NodeType

    forever = threading.Event()
    provider = CallbackProvider(lambda req: forever.wait(), lambda ids: None)
    with tidepool.LocalCluster(n_workers=0) as cluster, tidepool.Client(cluster) as client:
        cluster.adapt(node_types=[NodeType("cloud", {"cpu": 1}, max_nodes=1, startup_estimate=0.2)],
                      provider=provider, launch_timeout=1.0, max_type_failures=1)
        fut = client.submit(abs, -1)
        try:
            fut.result(timeout=60)
        except ProviderError as exc:
            print("FAILED-WITH", exc)
    print("CLOSED")
""")


def test_a_hanging_launch_is_bounded_and_never_blocks_exit() -> None:
    proc = subprocess.run([sys.executable, "-c", HANGING_LAUNCH], capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr
    assert "FAILED-WITH" in proc.stdout and "did not return within" in proc.stdout, proc.stdout + proc.stderr
    assert "CLOSED" in proc.stdout


def test_connecting_to_a_gone_peer_without_retry_fails_at_the_first_refusal() -> None:
    import asyncio
    import socket

    from tidepool.comm import connect

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now

    async def attempt() -> tuple[str, bool]:
        async def open_later() -> Any:  # the port starts answering a second later
            await asyncio.sleep(1.0)
            return await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)

        opener = asyncio.ensure_future(open_later())
        try:
            await connect(f"tcp://127.0.0.1:{port}", "t" * 32, timeout=5, retry=False)
        except ConnectionLostError as exc:
            return str(exc), not opener.done()
        finally:
            (await opener).close()
        return "connected", False

    msg, gave_up_first = asyncio.run(attempt())
    assert "could not connect" in msg and gave_up_first  # it did not wait for the port to open
