"""Preemptible node types: when to stop launching them and use their fallback, and when to go back.

State (:class:`FallbackTracker`, owned by the controller): per preemptible node type, the times of
its recent troubles (preemption notices and capacity errors: launches that failed or never
arrived), and, for types whose launches go to their fallback now, since when and why.  Pure: no
clock (``now`` comes in), no I/O; each switch returns a journal record the controller writes.

Rule, per node type (its own settings): ``fallback_after`` troubles within ``fallback_window``
seconds switch its launches to ``fallback`` (followed further if the fallback is switched too);
after ``fallback_healthy`` seconds without a trouble it is used again.  While a type is switched,
the policy sees it as blocked (``ClusterSnapshot.backoff``), so it plans for the other types, and
whatever it still asks of the type is launched as its fallback.

Place in the data flow: the controller reports troubles from its observation (``notices``, failed
launches) and routes the policy's launches and the replacements of preempted workers through
:meth:`FallbackTracker.route` before the limits (``max_nodes``, cost) are applied.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

from tidepool.scaling.node_types import NodeType


class FallbackTracker:
    def __init__(self, node_types: Mapping[str, NodeType]) -> None:
        self.node_types = node_types
        self.troubles: dict[str, deque[float]] = {}
        self.last_trouble: dict[str, float] = {}
        #: node type -> (since when its launches go to its fallback, why)
        self.switched: dict[str, tuple[float, str]] = {}

    def trouble(self, name: str, now: float, what: str) -> dict[str, Any] | None:
        """A preemption notice or a capacity error of ``name``; the switch record if it switched."""
        nt = self.node_types.get(name)
        if nt is None or (not nt.preemptible and nt.fallback is None):
            return None
        times = self.troubles.setdefault(name, deque())
        times.append(now)
        while times and times[0] < now - nt.fallback_window:
            times.popleft()
        self.last_trouble[name] = now
        if nt.fallback is None or name in self.switched or len(times) < nt.fallback_after:
            return None
        why = (f"{len(times)} preemptions or capacity errors of {name!r} within {nt.fallback_window:g}s "
               f"(fallback_after={nt.fallback_after}; last: {what}): launching {nt.fallback!r} instead until "
               f"{name!r} has been healthy for {nt.fallback_healthy:g}s")  # fmt: skip
        self.switched[name] = (now, why)
        return {"kind": "fallback", "t": now, "node_type": name, "to": nt.fallback, "reason": why}

    def recover(self, now: float) -> list[dict[str, Any]]:
        """Types healthy for their ``fallback_healthy`` seconds again: used again (records)."""
        out = []
        for name in sorted(self.switched):
            nt = self.node_types[name]
            quiet = now - self.last_trouble.get(name, -1e18)
            if quiet >= nt.fallback_healthy:
                del self.switched[name]
                self.troubles.pop(name, None)
                out.append({"kind": "fallback-end", "t": now, "node_type": name, "to": name, "reason": (
                    f"no preemption or capacity error of {name!r} for {quiet:.0f}s (fallback_healthy="
                    f"{nt.fallback_healthy:g}s): launching {name!r} again")})  # fmt: skip
        return out

    def route(self, name: str) -> str:
        """Where a launch of ``name`` goes now: itself, or its fallback (followed while switched)."""
        seen = {name}
        while name in self.switched:
            nxt = self.node_types[name].fallback
            if nxt is None or nxt in seen or nxt not in self.node_types:
                break
            seen.add(nxt)
            name = nxt
        return name

    def blocked_until(self, now: float) -> dict[str, float]:
        """Switched types as the policy should see them: blocked until they could recover."""
        return {n: self.last_trouble.get(n, now) + self.node_types[n].fallback_healthy for n in self.switched}
