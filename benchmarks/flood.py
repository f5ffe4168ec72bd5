"""Idle-socket floods against a real `tidepool scheduler`: do real clients get through, and what does
each pending socket cost?

For each transport (tcp, tls) a scheduler process is started, then a flooder thread keeps
``--sockets`` (1,100) idle connections open from 127.0.0.1, reopening each as soon as the scheduler
closes it, for ``--seconds`` (30).  Meanwhile ``--clients`` (10) real clients connect one after the
other, each with a 10 s timeout; the row gives how many got through and their median connect time,
and the scheduler's RSS before and at the peak of the flood, divided by the sockets held.

Before issue 29's change: 0 of 10 real clients got through such a flood (a full table refused
every newcomer), and each pending TLS socket cost ~261 KiB (TCP ~18 KiB).

Run from the repository root::

    .venv/bin/python benchmarks/flood.py [--sockets 1100] [--seconds 30] [--write-docs]
"""

from __future__ import annotations

import argparse
import multiprocessing
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import tidepool  # noqa: E402
from test_cli import Proc, clean_env, free_port, tidepool_cmd  # noqa: E402
from tidepool.comm.tls import TLSConfig, make_certs  # noqa: E402

LINE = re.compile(r"tidepool scheduler at ((?:tcp|tls)://\S+)")


def flood(host: str, port: int, n: int, stop: Any, stats: Any) -> None:
    """Keep ``n`` idle sockets open, reopening each the scheduler closes (runs in its own process,
    as an attacker would: it must not take the real clients' interpreter lock)."""
    live: list[socket.socket] = []
    try:
        while not stop.is_set():
            while len(live) < n and not stop.is_set():
                s = socket.socket()
                s.settimeout(2)
                try:
                    s.connect((host, port))
                except OSError:
                    s.close()
                    break
                s.setblocking(False)
                live.append(s)
                stats[0] += 1
            time.sleep(0.01)
            for s in list(live):
                try:
                    if s.recv(1, socket.MSG_PEEK) == b"":
                        raise ConnectionResetError
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                s.close()
                live.remove(s)
            stats[1] = max(stats[1], len(live))
    finally:
        for s in live:
            s.close()


def one(scheme: str, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    port = free_port()
    token_file = tmp / f"token-{scheme}"
    tls: TLSConfig | None = None
    extra: list[str] = []
    if scheme == "tls":
        tls = make_certs(tmp / "certs")
        extra = ["--tls-ca-file", tls.ca, "--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
    sched = Proc(tidepool_cmd("scheduler", "--port", str(port), "--token-file", str(token_file), *extra),
                 tmp / f"{scheme}.err", clean_env())  # fmt: skip
    try:
        address = sched.wait_for_line(LINE).group(1)
        proc = psutil.Process(sched.popen.pid)
        rss0 = proc.memory_info().rss
        stop = multiprocessing.Event()
        stats = multiprocessing.Array("q", 2)  # opened, most held
        t = multiprocessing.Process(target=flood, args=("127.0.0.1", port, args.sockets, stop, stats), daemon=True)
        t.start()
        peak = rss0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # let the flood fill the table first
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.1)
        times: list[float] = []
        ok = 0
        end = time.monotonic() + args.seconds
        for _ in range(args.clients):
            t0 = time.monotonic()
            try:
                with tidepool.Client(address, token=token_file.read_text().strip(), timeout=10, tls=tls):
                    ok += 1
                    times.append(time.monotonic() - t0)
            except Exception as exc:  # noqa: BLE001 - a refusal is what we count
                print(f"  {scheme}: a real client failed: {type(exc).__name__}: {exc}")
            peak = max(peak, proc.memory_info().rss)
        while time.monotonic() < end:
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.2)
        stop.set()
        t.join(30)
        if t.is_alive():
            t.kill()
        held = max(1, stats[1])
        return {"ok": ok, "connect": statistics.median(times) if times else float("nan"), "rss0": rss0,
                "peak": peak, "per_socket": (peak - rss0) / held, "held": held, "opened": stats[0]}  # fmt: skip
    finally:
        sched.reap()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--sockets", type=int, default=1100)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for scheme in ("tcp", "tls"):
            r = one(scheme, args, Path(d))
            rows.append(f"| {scheme} | {r['held']:.0f} | {r['opened']:.0f} | {r['ok']:.0f} of {args.clients} | "
                        f"{r['connect'] * 1000:.0f} ms | {r['rss0'] / 2**20:.0f} MiB | {r['peak'] / 2**20:.0f} MiB | "
                        f"{r['per_socket'] / 1024:.1f} KiB |")  # fmt: skip
    header = ("| port | idle sockets held | opened in all | real clients through | median connect | RSS before | "
              "RSS peak | per held socket |\n|---|--:|--:|--:|--:|--:|--:|--:|")
    table = "\n".join([header, *rows])
    print(table)
    if args.write_docs:
        path = ROOT / "docs" / "benchmarks.md"
        text = path.read_text()
        section = (f"<!-- flood:start -->\n{table}\n\nA flood of {args.sockets} idle sockets from 127.0.0.1, each "
                   f"reopened as soon as it is closed, for {args.seconds:g} s (`benchmarks/flood.py`). Before "
                   "issue 29: 0 of 10 real clients got through, and a pending TLS socket cost ~261 KiB.\n"
                   "<!-- flood:end -->")  # fmt: skip
        if "<!-- flood:start -->" in text:
            text = re.sub(r"<!-- flood:start -->.*<!-- flood:end -->", lambda _: section, text, flags=re.S)
        else:
            text += "\n\n## Idle-socket floods\n\n" + section + "\n"
        path.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
