"""How a cluster or client describes itself (``repr`` and Jupyter's ``_repr_html_``): its address,
workers per node type and the dashboard link.  Pure formatting; no dependency on aiohttp."""

from __future__ import annotations

import html
from typing import Any


def _workers(by_type: dict[str, int]) -> str:
    total = sum(by_type.values())
    if not by_type:
        return "0 workers"
    parts = ", ".join(f"{nt}: {n}" for nt, n in sorted(by_type.items()))
    return f"{total} worker{'s' if total != 1 else ''} ({parts})"


def without_token(link: str) -> str:
    """``link`` without its ``?token=...``: a repr is what logs and saved notebooks keep (a review:
    the token, which runs code on every worker, was in both); the link itself is
    ``cluster.dashboard_link``."""
    base, sep, query = link.partition("?")
    if not sep or not any(p.startswith("token=") for p in query.split("&")):
        return link
    rest = "&".join(p for p in query.split("&") if not p.startswith("token="))
    return f"{base}?{rest}" if rest else base


def describe(kind: str, address: str, by_type: dict[str, int], link: str, closed: bool = False) -> str:
    """``<LocalCluster tcp://... 2 workers (default: 2) dashboard=http://127.0.0.1:8787/>``."""
    state = " closed" if closed else ""
    link = without_token(link)
    dash = f" dashboard={link}" if link else ""
    return f"<{kind} {address}{state} {_workers(by_type)}{dash}>"


def describe_html(kind: str, address: str, by_type: dict[str, int], link: str, closed: bool = False) -> str:
    rows = "".join(f"<tr><td>{html.escape(nt)}</td><td>{n}</td></tr>" for nt, n in sorted(by_type.items()))
    link = without_token(link)
    dash = (f'<p>Dashboard: <a href="{html.escape(link)}" target="_blank">{html.escape(link)}</a></p>'
            if link else "<p>Dashboard: off</p>")  # fmt: skip
    return (f"<div><h4>{html.escape(kind)}{' (closed)' if closed else ''}</h4>"
            f"<p>Scheduler: <code>{html.escape(address)}</code> · {html.escape(_workers(by_type))}</p>{dash}"
            f"<table><thead><tr><th>node type</th><th>workers</th></tr></thead><tbody>{rows}</tbody></table></div>")


def client_repr(client: Any, html: bool = False) -> str:
    """A client's repr: its scheduler's workers per node type and dashboard link (asked of the
    scheduler; a closed or unreachable client says so instead)."""
    by_type: dict[str, int] = {}
    link = ""
    closed = bool(client.closed)
    if not closed:
        try:
            info = client.scheduler_info()
        except Exception:  # noqa: BLE001 - a repr never raises
            info = {}
        for w in info.get("workers", ()):
            by_type[w["node_type"]] = by_type.get(w["node_type"], 0) + 1
        link = str(info.get("dashboard") or "")
    if html:
        return describe_html("tidepool.Client", client.address, by_type, link, closed)
    return describe("tidepool.Client", client.address, by_type, link, closed)


__all__ = ["client_repr", "describe", "describe_html", "without_token"]
