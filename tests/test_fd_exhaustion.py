"""Out of file descriptors, the scheduler logs one line per interval with counts, not a traceback
per failed ``accept()`` (thousands within seconds before).

Real exhaustion: the scheduler runs in a child process with ``RLIMIT_NOFILE`` at 64, and this test
opens 120 connections to it.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration

SCHEDULER = textwrap.dedent("""
    import asyncio, logging, resource, sys
    from tidepool.comm import accept_errors
    from tidepool.scheduler.server import Scheduler

    logging.basicConfig(level=logging.WARNING, format="%(name)s %(levelname)s %(message)s")
    accept_errors.ACCEPT_LOG_INTERVAL = 1.0
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))

    async def main():
        s = await Scheduler("tcp://127.0.0.1:0").start()
        print(s.address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until told
        await asyncio.sleep(1.5)  # the last window's count is said when it ends
        await s.close()

    asyncio.run(main())
""")


def test_descriptor_exhaustion_is_logged_once_per_interval_with_counts() -> None:
    p = subprocess.Popen([sys.executable, "-c", SCHEDULER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    socks: list[socket.socket] = []
    try:
        assert p.stdout is not None and p.stdin is not None
        host, port = p.stdout.readline().strip().removeprefix("tcp://").rsplit(":", 1)
        for _ in range(120):
            try:
                socks.append(socket.create_connection((host, int(port)), timeout=2))
            except OSError:
                pass
        p.stdin.write("\n")
        p.stdin.flush()
        _, err = p.communicate(timeout=60)
    finally:
        for s in socks:
            s.close()
        if p.poll() is None:
            p.kill()
    assert "Traceback" not in err, err[:3000]
    lines = [ln for ln in err.splitlines() if "accepting connections failed" in ln]
    assert lines, err[:3000]
    counts = [int(m.group(1)) for ln in lines if (m := re.search(r"failed (\d+) time", ln))]
    assert "Too many open files" in lines[0] and "limit 64" in lines[0]
    assert sum(counts) > len(lines)  # counted, not one line each
    assert "out of system resource" not in err  # asyncio's own per-accept report is gone
