"""Data between workers: fetching values from peers, and the data server's replies.

State: one open connection (and its lock) per peer, and the keys to ask each peer for in the next
request (:class:`Peers`); the data server itself keeps nothing (:func:`data_reply` reads the
worker's store).  Data flow: the worker shell asks :meth:`Peers.fetch` for an input when its
:class:`~tidepool.worker.state.WorkerState` says ``Fetch``; every key asked of one peer within a
loop turn goes out as one ``get-data`` request (a shuffle stage reads dozens of small pieces from
each peer).  A peer that sends nothing for ``fetch_timeout`` seconds is *silent* (suspect, not
dead); a refused connection means it is gone.  Replies hold what fits in one frame; the rest is
``deferred`` (asked again), values that can never be sent are ``failed``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from tidepool.comm import Connection, Serialized, connect, serialize
from tidepool.comm.data import request_data
from tidepool.comm.tls import TLSConfig
from tidepool.errors import CommError, PeerSilentError

log = logging.getLogger("tidepool.worker")

#: times a value may fail to serialise for lack of memory before the futures wanting it fail
MAX_SERVE_TRIES = 3

#: what fetching a value gives: ("ok", value), or (kind, reason) with kind "missing", "silent"
#: (the last holder tried stalled) or "broken" (it exists but cannot reach us)
Fetched = tuple[str, Any]


def listen_host(scheduler: str) -> str:
    """Where the data server listens: loopback for a local scheduler (on loopback, or a Unix
    socket), else every interface (or
    ``$TIDEPOOL_WORKER_HOST``)."""
    from tidepool.comm.core import parse_address

    scheme, host, _ = parse_address(scheduler)
    if scheme == "unix" or host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return os.environ.get("TIDEPOOL_WORKER_HOST", "0.0.0.0")


class Peers:
    """Connections to other workers' data servers, and batched requests over them."""

    def __init__(self, token: str, tls: TLSConfig | None, fetch_timeout: float) -> None:
        self.token = token
        self.tls = tls
        self.fetch_timeout = fetch_timeout
        self.conns: dict[str, tuple[Connection, asyncio.Lock]] = {}
        #: keys to ask each peer for in one request, sent on the next loop turn (see _batched): key ->
        #: what fetching it gave, ``({key: value}, {})``, ``({}, {key: why not})`` or ``({}, {})``
        self._batches: dict[str, dict[str, asyncio.Future[tuple[dict[str, Any], dict[str, str]]]]] = {}

    async def fetch(self, key: str, holders: list[list[str]] | tuple[tuple[str, str], ...]) -> Fetched:
        """Copy ``key`` from the first of ``holders`` (``[worker id, address]``) that has it."""
        outcome: Fetched = ("missing", "no holder known")
        for _wid, addr in holders:
            try:
                # shielded: another task waiting for the same key, cancelled, must not cancel it here
                got, failed = await asyncio.shield(self._batched(addr, key))
            except PeerSilentError as exc:
                log.warning("fetching %s from %s stalled: %s", key, addr, exc)
                outcome = ("silent", str(exc))
                continue
            except CommError as exc:
                log.info("fetching %s from %s failed: %s", key, addr, exc)
                outcome = ("missing", str(exc))
                continue
            except Exception as exc:  # noqa: BLE001 - whatever broke, the task must hear an outcome
                # (a bug here, or a transport's own error: the fetch task died with it, and the task
                # that needed the value waited for ever; the demo hung on one)
                log.warning("fetching %s from %s failed: %s: %s", key, addr, type(exc).__name__, exc)
                outcome = ("missing", f"{type(exc).__name__}: {exc}")
                continue
            if key in failed:
                return ("broken", failed[key])
            if key in got:
                return ("ok", got[key])
            outcome = ("missing", f"{addr} does not hold it")
        return outcome

    async def get(self, address: str, keys: list[str],
                  on_reply: Callable[[dict[str, Any], dict[str, str]], None] | None = None,
                  ) -> tuple[dict[str, Any], dict[str, str]]:  # fmt: skip
        """Values of ``keys`` held at ``address``, and why some could not be had (key -> reason);
        with ``on_reply``, handed over reply by reply instead (see ``request_data``)."""
        entry = self.conns.get(address)
        if entry is None or entry[0].closed:
            # a refused connection means the peer is gone: fail now, the scheduler reschedules
            try:
                conn = await connect(address, self.token, timeout=5, hello={"role": "peer"}, retry=False,
                                     tls=self.tls)  # fmt: skip
            except CommError as exc:
                if isinstance(exc.__cause__, TimeoutError):  # no answer at all, not a refusal: silent
                    raise PeerSilentError(f"{address} did not answer: {exc}") from exc
                raise
            entry = self.conns[address] = (conn, asyncio.Lock())
        conn, lock = entry
        return await request_data(conn, lock, keys, self.fetch_timeout, on_reply=on_reply)

    def _batched(self, address: str, key: str) -> asyncio.Future[tuple[dict[str, Any], dict[str, str]]]:
        """``get(address, [key, ...])`` for every key asked of that peer in this loop turn: one
        request for a task's inputs instead of a round trip per key.  Each key's future is set as
        the reply holding it arrives, so its value is stored (and spilled) before the rest come."""
        batch = self._batches.get(address)
        if batch is None:
            loop = asyncio.get_running_loop()
            batch = self._batches[address] = {}
            loop.call_soon(lambda: loop.create_task(self._send_batch(address)))
        fut = batch.get(key)
        if fut is None:
            fut = batch[key] = asyncio.get_running_loop().create_future()
        return fut

    async def _send_batch(self, address: str) -> None:
        futs = self._batches.pop(address)

        def arrived(got: dict[str, Any], failed: dict[str, str]) -> None:
            # each future leaves the batch as it is set: the batch must not keep its value alive
            for k, v in got.items():
                f = futs.pop(k, None)
                if f is not None and not f.done():
                    f.set_result(({k: v}, {}))
            for k, why in failed.items():
                f = futs.pop(k, None)
                if f is not None and not f.done():
                    f.set_result(({}, {k: why}))

        try:
            await self.get(address, list(futs), on_reply=arrived)
        except asyncio.CancelledError:  # the worker is closing: its askers stop too
            for f in futs.values():
                f.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - every key not had yet sees the peer's failure
            for f in futs.values():
                if not f.done():
                    f.set_exception(exc)
                    f.exception()  # retrieved here too: a batch whose askers left logs nothing
        for f in futs.values():
            if not f.done():  # the peer does not hold it
                f.set_result(({}, {}))

    def close(self) -> None:
        for conn, _ in self.conns.values():
            conn.close()


def data_reply(keys: list[str], limit: int, store: Mapping[str, Any], nbytes: Callable[[str], int],
               serve_failures: dict[str, int], unservable: Callable[[str, str, str], None],
               reply_bytes: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The data server's answer to ``get-data``: serialise what fits in one frame (and in
    ``reply_bytes``, if given: a worker with a memory limit holds a reply's values at once, read back
    from disk if spilled, so one gather of many spilled values must not read them all at once); the
    rest is ``deferred`` (ask again; a reply always carries at least one value).  Values that can
    never be sent are ``failed``, and ``unservable(key, error type, message)`` is called for each
    (the worker drops them and tells the scheduler).  A value whose pickling ran out of memory
    raises ``MemoryError`` (the connection closes, the asker tries again or elsewhere) until it
    happened :data:`MAX_SERVE_TRIES` times."""
    data: dict[str, Serialized] = {}
    missing: list[str] = []
    failed: dict[str, str] = {}
    deferred: list[str] = []
    budget = limit - 64 * 1024  # room for the header
    if reply_bytes is not None:
        budget = min(budget, reply_bytes)
    for k in keys:
        if k not in store:
            missing.append(k)
            continue
        size = nbytes(k)
        if data and size > budget:
            deferred.append(k)
            continue
        why = ""
        if size > limit:  # do not even try to pickle it
            why = (f"its value is about {size:,} bytes, over the {limit:,}-byte frame "
                   "limit; return something smaller (or a handle to data on shared storage)")  # fmt: skip
            typ = "ResultTooLargeError"
        else:
            try:
                ser = serialize(store[k])
            except MemoryError as exc:
                tries = serve_failures[k] = serve_failures.get(k, 0) + 1
                if tries < MAX_SERVE_TRIES:
                    # maybe short of memory only now: keep the value, and let the connection
                    # close so the asker tries again or elsewhere at once (no timeout)
                    log.warning("out of memory serialising %r for a peer (try %d of %d); closing that "
                                "connection", k, tries, MAX_SERVE_TRIES)  # fmt: skip
                    raise
                why = (f"serialising its value ran out of memory {tries} times ({type(exc).__name__}{': ' if str(exc) else ''}{exc}); "
                       "raise the worker's memory (or address-space) limit, or return something smaller")  # fmt: skip
                typ = "SerializationError"
            except Exception as exc:  # noqa: BLE001 - any pickling failure is the value's
                why = (f"its value of type {type(store[k]).__name__} cannot be pickled: "
                       f"{type(exc).__name__}: {exc}")  # fmt: skip
                typ = "SerializationError"
            if not why:
                if ser.nbytes > limit:
                    why = (f"its value pickles to {ser.nbytes:,} bytes, over the {limit:,}-byte frame "
                           "limit; return something smaller (or a handle to data on shared storage)")  # fmt: skip
                    typ = "ResultTooLargeError"
                elif data and ser.nbytes > budget:
                    deferred.append(k)
                    continue
                else:
                    data[k] = ser
                    budget -= ser.nbytes
                    continue
        message = f"task {k!r} produced a value that cannot be sent: {why}"
        serve_failures.pop(k, None)
        failed[k] = message
        log.warning("%s", message)
        unservable(k, typ, message)
    return {"op": "data", "data": data, "missing": missing, "failed": failed, "deferred": deferred}
