"""Admission of unauthenticated connections: how many may wait, for how long, and who gives way.

State: the pending table, every accepted TCP connection that has not authenticated yet, oldest
first, with its source address.  Place in the data flow: the listener's accept loop puts each new
socket here, then sniffs its first bytes (a TLS ClientHello, or tidepool's plain-TCP preamble),
then runs the token handshake; the entry leaves the table when the peer has authenticated or is
gone.

Why a table with eviction instead of a plain cap (issue 29): a cap refuses the *newest*
connection once an idle flood has filled it, so a flood that reopens its sockets as they close
locks every real peer out.  Here the newest connection always gets in and an old pending one gives
way, globally and per source address: the oldest that has sent nothing yet, and only when every
pending connection has talked, the oldest of those.  A real peer sends its first bytes at once and
authenticates within milliseconds; an idle socket never talks, so a flood of them evicts only
itself.  The time a pending connection may take shrinks while the table is more than half full.

Pure bookkeeping: the table closes evicted entries through the callback it was given, and reads
no clock (the listener applies the deadline it returns).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

#: a plain-TCP dialer sends these bytes before anything else, so that a listener can tell a tidepool
#: peer from a TLS ClientHello (first byte 0x16) and from noise, before spending anything on it
PLAIN_PREAMBLE = b"TDP\x01"
#: the first byte of a TLS record carrying a handshake message (the ClientHello)
TLS_HANDSHAKE_RECORD = 0x16


@dataclass
class _Entry:
    source: str
    close: Callable[[], object]
    active: bool = False  # it has sent its first bytes: a peer that talks, not an idle socket
    spoke: Callable[[], bool] | None = None  # have its first bytes arrived (not yet read)?


@dataclass
class PendingTable:
    """Connections that have not authenticated yet, oldest first.

    ``limit`` bounds the whole table and ``per_source`` the entries of one source address; adding
    past either evicts (closes) the oldest entry that is over it.  ``limit <= 0`` admits nothing.
    """

    limit: int
    per_source: int
    normal_deadline: float
    pressure_deadline: float
    _entries: collections.OrderedDict[int, _Entry] = field(default_factory=collections.OrderedDict)
    _by_source: collections.Counter[str] = field(default_factory=collections.Counter)
    evicted: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: int, source: str, close: Callable[[], object],
            spoke: Callable[[], bool] | None = None) -> bool:  # fmt: skip
        """Admit ``key``; False (and nothing is added) when the table admits nothing at all.
        ``spoke`` tells whether the entry's first bytes have arrived even though nobody has read
        them yet (on a busy loop a real peer's preamble may wait there a while)."""
        if self.limit <= 0 or self.per_source <= 0:
            return False
        while self._by_source[source] >= self.per_source:
            self._evict_oldest(source)
        while len(self._entries) >= self.limit:
            self._evict_oldest(None)
        self._entries[key] = _Entry(source, close, spoke=spoke)
        self._by_source[source] += 1
        return True

    def promote(self, key: int) -> None:
        """``key`` has sent its first bytes: idle entries give way before it does."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.active = True

    def remove(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._forget(entry.source)

    def deadline(self) -> float:
        """Seconds a connection admitted now may take to authenticate: shorter under pressure."""
        if len(self._entries) * 2 >= self.limit:
            return self.pressure_deadline
        return self.normal_deadline

    def _evict_oldest(self, source: str | None) -> None:
        """Close the oldest entry (of ``source``, if given) that has sent nothing; if every one has
        talked, the oldest of them."""
        victim: int | None = None
        for key, entry in self._entries.items():
            if source is None or entry.source == source:
                if not entry.active and entry.spoke is not None and entry.spoke():
                    entry.active = True  # it talks, we had not looked yet
                if not entry.active:
                    victim = key
                    break
                if victim is None:
                    victim = key
        if victim is None:
            raise AssertionError("eviction found nothing to evict")  # counts and entries disagree
        entry = self._entries.pop(victim)
        self._forget(entry.source)
        self.evicted += 1
        entry.close()

    def _forget(self, source: str) -> None:
        self._by_source[source] -= 1
        if self._by_source[source] <= 0:
            del self._by_source[source]
