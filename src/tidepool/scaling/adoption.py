"""After a scheduler restart: the instances the autoscaler had, found again in the provider's listing.

State: none; functions over an :class:`~tidepool.scaling.instances.InstanceTable`.

Data flow: each controller step turns its table into rows (:func:`instance_rows`: node type,
request id, lifecycle state, origin of every instance not ended) and hands the rows that changed
(:func:`row_changes`) to the shell in ``Actions.instances``; a durable scheduler stores them in its
state directory once a tick.  A restarted scheduler constructs its controller with the stored rows
(``ScalingController(restored=...)``); the controller launches nothing until an observation carries
the provider's listing, then :func:`adopt` reconciles the two: a row whose worker the provider
still lists alive is adopted (back in the table at ``named``, in a request of the same id, so it
counts as on its way until it re-registers and is given up, and terminated, if it never does); a
row the provider no longer lists is gone.  A worker the listing names with a request id but no row
(launched in the tick before the scheduler died) is adopted too.  Each outcome is one ``adopt``
journal record.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from tidepool.scaling.instances import FINAL, IS, InstanceTable

Row = dict[str, Any]


def instance_rows(table: InstanceTable) -> dict[str, Row]:
    """Every instance not ended, as a row to store."""
    return {w: {"node_type": i.node_type, "request": i.request, "state": str(i.state), "origin": i.origin}
            for w, i in table.instances.items() if i.state not in FINAL}  # fmt: skip


def row_changes(before: Mapping[str, Row], now: Mapping[str, Row]) -> dict[str, Row | None]:
    """The rows to write (changed or new) and to delete (``None``)."""
    out: dict[str, Row | None] = {w: r for w, r in now.items() if before.get(w) != r}
    out.update({w: None for w in before if w not in now})
    return out


def adopt(table: InstanceTable, rows: Mapping[str, Mapping[str, Any]], listing: Mapping[str, Mapping[str, Any]],
          now: float, timeout_of: Callable[[str], float]) -> list[Row]:  # fmt: skip
    """Put the listed workers of ``rows`` (and listed ones of a launch without a row) back in
    ``table``; returns one journal record (without kind and time) per worker."""
    found: dict[str, Row] = {w: dict(r) for w, r in rows.items()}
    for wid, info in listing.items():
        if wid not in found and info.get("request_id") and info.get("alive", True):
            found[wid] = {"node_type": str(info.get("node_type") or ""), "request": str(info["request_id"]),
                          "state": "", "origin": "launched"}  # fmt: skip
    records: list[Row] = []
    by_request: dict[str, list[str]] = {}
    for wid in sorted(found):
        row = found[wid]
        seen = listing.get(wid)
        base = {"worker": wid, "request": row.get("request"), "node_type": row.get("node_type"),
                "was": row.get("state") or "not stored"}  # fmt: skip
        if seen is None or not seen.get("alive", True):
            why = "the provider does not list it any more" if seen is None else "the provider lists it as ended"
            records.append({**base, "outcome": "gone", "reason": why})
            continue
        if table.get(wid) is not None:
            continue
        rid = row.get("request")
        why = "listed by the provider after the scheduler restarted"
        if rid is None:
            table.add(wid, str(row.get("node_type") or ""), None, IS.NAMED, now, why,
                      origin=str(row.get("origin") or "adopted"))  # fmt: skip
        else:
            by_request.setdefault(str(rid), []).append(wid)
        records.append({**base, "outcome": "adopted", "reason": why})
    for rid, wids in by_request.items():
        node_type = str(found[wids[0]].get("node_type") or "")
        req = table.requests.get(rid)
        if req is None:
            req = table.request(rid, node_type, len(wids), now, now + timeout_of(node_type),
                                "adopted after a scheduler restart")  # fmt: skip
            table.move_request(req, IS.NAMED, now, f"{len(wids)} of its workers are still listed by the provider")
        for wid in wids:
            table.add(wid, node_type, rid, IS.NAMED, now, "adopted: listed by the provider after a restart")
            table.enlist(req, wid)
    return records
