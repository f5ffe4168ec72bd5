"""The scheduler address that *remote* workers dial (shared by the SSH and Slurm providers).

A scheduler bound to all interfaces reports ``tcp://0.0.0.0:PORT``, which is useless on another
machine.  Providers that start workers elsewhere pass the bound address through
:func:`contact_address`: an explicit ``scheduler_host`` replaces the host part (keeping the port
the scheduler really got), and a wildcard host becomes this machine's fully qualified name.
"""

from __future__ import annotations

import socket

_WILDCARDS = ("0.0.0.0", "::", "")


def contact_address(bound: str, host: str | None = None) -> str:
    """``bound`` with its host replaced by ``host`` (or by this machine's name if it is a wildcard)."""
    scheme, sep, rest = bound.partition("://")
    if not sep or ":" not in rest:
        return bound
    hostpart, _, port = rest.rpartition(":")
    current = hostpart.strip("[]")
    if host:
        new = host
    elif current in _WILDCARDS:
        new = socket.getfqdn()
    else:
        return bound
    if ":" in new and not new.startswith("["):
        new = f"[{new}]"
    return f"{scheme}://{new}:{port}"
