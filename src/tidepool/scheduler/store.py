"""The scheduler's state directory: an SQLite database (WAL mode) of what it needs to carry on.

State
-----
One file, ``state.sqlite3``, in the directory given by ``--state-dir`` (created mode 700; the
token is in it).  Tables: ``meta`` (layout version, token, address, the autoscaler's cost meter as of the last tick), ``functions`` (function id ->
pickled callable), ``tasks`` (one row per task the scheduler knows: its spec as submitted, and its
outcome: ``p`` pending, ``m`` finished with the workers holding the value, ``e`` erred with the
error), ``wants`` (client id -> keys it holds futures of), ``workers`` (workers registered at the
last flush: a restarted scheduler waits for them a little before it recomputes what they hold),
``instances`` (the autoscaler's launched instances and their provider ids), ``setups`` (the
setup hooks clients registered, pickled, in registration order: workers that join after a restart
run them).  Tables added after layout version 1 (``setups``) are created empty when an older store
is opened: a store without them reads as one without setups.

Data flow
---------
:class:`~tidepool.scheduler.recovery.Persister` (a scheduler observer) collects what changed and
hands one :class:`Batch` per scheduler tick to :meth:`StateStore.write`, which applies it in one
transaction on a writer thread: the event loop never waits on a disk write, and
``synchronous=NORMAL`` in WAL mode syncs only at checkpoints, so a crash at any byte loses at most
the transactions since the last one that reached the disk (a torn WAL tail fails its checksum and
is dropped whole by SQLite: never half a tick).  Released tasks leave the table as the scheduler
forgets them, so the file stays as small as the live graph.  :meth:`StateStore.load` reads
everything in one read transaction and decodes all of it before anyone uses it: a store that is
corrupt, from another layout version or from another cluster (token) raises a
:class:`~tidepool.errors.StateStoreError` subclass and nothing is half-loaded.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import json
import logging
import os
import queue
import sqlite3
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tidepool.comm.serialize import Serialized
from tidepool.errors import (
    StateStoreError,
    StoreCorruptError,
    StoreInUseError,
    StoreTokenError,
    StoreVersionError,
)

#: the layout of the tables below; a store with another number is refused, never guessed at
LAYOUT_VERSION = 1
log = logging.getLogger("tidepool.store")

FILE_NAME = "state.sqlite3"
#: the directory lock (one scheduler per state directory); holds the owner's pid
LOCK_NAME = "lock"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS functions (fid TEXT PRIMARY KEY, blob BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS tasks (
    seq INTEGER PRIMARY KEY, key TEXT UNIQUE NOT NULL, spec TEXT NOT NULL, payload BLOB,
    status TEXT NOT NULL, holders TEXT NOT NULL DEFAULT '[]', error BLOB
);
CREATE TABLE IF NOT EXISTS wants (client TEXT NOT NULL, key TEXT NOT NULL, PRIMARY KEY (client, key))
    WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS workers (id TEXT PRIMARY KEY, address TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS instances (id TEXT PRIMARY KEY, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS setups (seq INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, blob BLOB NOT NULL);
"""


# ---- what goes in and comes out -------------------------------------------------------------------
@dataclass(slots=True)
class StoredTask:
    """One task as submitted (``spec``: func id, deps, resources, retries, group, priority, workers,
    loose) with its last flushed outcome."""

    key: str
    spec: list[Any]
    payload: Serialized | None
    status: str = "p"  # p: pending (or running), m: finished (``holders`` hold it), e: erred
    holders: list[str] = field(default_factory=list)
    error: dict[str, Any] | None = None


@dataclass(slots=True)
class Batch:
    """Everything that changed during one tick, applied in one transaction."""

    new_tasks: list[StoredTask] = field(default_factory=list)
    #: key -> (status, holders, error) for tasks already stored
    outcomes: dict[str, tuple[str, list[str], dict[str, Any] | None]] = field(default_factory=dict)
    forgotten: list[str] = field(default_factory=list)
    functions: dict[str, Serialized] = field(default_factory=dict)
    wants_added: list[tuple[str, str]] = field(default_factory=list)
    wants_removed: list[tuple[str, str]] = field(default_factory=list)
    workers_joined: list[tuple[str, str]] = field(default_factory=list)
    workers_left: list[str] = field(default_factory=list)
    instances: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # None: gone
    setups: dict[str, Serialized | None] = field(default_factory=dict)  # name -> pickled SetupSpec (latest
    # wins; None: unregistered)
    cost: dict[str, Any] | None = None  # the autoscaler's cost meter (replaces the stored one)
    clear_tasks: bool = False  # client.restart(): every task is forgotten first

    def __bool__(self) -> bool:
        return bool(self.new_tasks or self.outcomes or self.forgotten or self.functions or self.wants_added
                    or self.wants_removed or self.workers_joined or self.workers_left or self.instances
                    or self.setups or self.cost is not None or self.clear_tasks)  # fmt: skip


@dataclass(slots=True)
class Snapshot:
    """The whole store, decoded: tasks in submission order (inputs before the tasks that use them)."""

    address: str
    tasks: list[StoredTask]
    functions: dict[str, Serialized]
    wants: dict[str, list[str]]
    workers: dict[str, str]
    instances: dict[str, dict[str, Any]]
    setups: list[tuple[str, Serialized]] = field(default_factory=list)  # in registration order
    cost: dict[str, Any] | None = None  # the autoscaler's cost meter at the last flush


# ---- payload encoding ---------------------------------------------------------------------------
def pack(ser: Serialized | None) -> bytes | None:
    """A :class:`Serialized` as one blob: buffer count, lengths, the stream, the buffers."""
    if ser is None:
        return None
    parts = [bytes(ser.data), *(bytes(b) for b in ser.buffers)]
    head = struct.pack(f"<I{len(parts)}Q", len(parts), *(len(p) for p in parts))
    return head + b"".join(parts)


def unpack(blob: bytes | None) -> Serialized | None:
    if blob is None:
        return None
    (n,) = struct.unpack_from("<I", blob)
    lengths = struct.unpack_from(f"<{n}Q", blob, 4)
    pos = 4 + 8 * n
    parts = []
    for ln in lengths:
        if pos + ln > len(blob):
            raise ValueError("payload blob shorter than its header says")
        parts.append(memoryview(blob)[pos:pos + ln])
        pos += ln
    return Serialized(bytes(parts[0]), parts[1:])


def _pack_error(error: dict[str, Any] | None) -> bytes | None:
    if error is None:
        return None
    plain = {k: v for k, v in error.items() if k != "exception"}
    body = json.dumps(plain).encode()
    exc = pack(error.get("exception"))
    return struct.pack("<Q", len(body)) + body + (exc or b"")


def _unpack_error(blob: bytes | None) -> dict[str, Any] | None:
    if blob is None:
        return None
    (n,) = struct.unpack_from("<Q", blob)
    error: dict[str, Any] = json.loads(bytes(blob[8:8 + n]))
    rest = blob[8 + n:]
    error["exception"] = unpack(rest) if rest else None
    return error


def _cost(text: str) -> dict[str, Any]:
    cost = json.loads(text)
    if not isinstance(cost, dict) or not isinstance(cost.get("open", []), list):
        raise ValueError("the stored cost meter is unreadable")
    return cost


# ---- the store ------------------------------------------------------------------------------------
def check_free(directory: Path) -> None:
    """Raise :class:`StoreInUseError` if a scheduler holds ``directory`` now (a process about to
    start one on it reports that as itself, not as its child's exit)."""
    _lock_directory(directory).close()


def _lock_directory(directory: Path) -> IO[str]:
    """An exclusive lock on ``directory`` for as long as the returned file is open: a second
    scheduler on the same directory is refused (it loaded the live store and released the first
    one's clients as if they had not come back).  The lock file holds the owner's pid."""
    try:
        f = open(directory / LOCK_NAME, "a+")  # noqa: SIM115 - held open for the store's life
    except OSError as exc:
        raise StateStoreError(f"cannot open {directory / LOCK_NAME}: {exc.strerror or exc}; the state directory "
                              "must be writable by the scheduler") from exc  # fmt: skip
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            # a file system without locks (NFS without lockd, Lustre mounted noflock): run unlocked
            log.warning("cannot lock the state directory %s (%s); one scheduler at a time is not enforced there",
                        directory, exc.strerror or exc)  # fmt: skip
            return f
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise StoreInUseError(
            f"the state directory {directory} is in use by another scheduler"
            f"{f' (pid {holder})' if holder else ''}; stop that one first, or give this one its own "
            "--state-dir") from None  # fmt: skip
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


class StateStore:
    """The state directory's database; see the module docstring.

    ``token``: the cluster's token; None adopts the store's (a fresh store then needs one).
    Raises :class:`StoreCorruptError`, :class:`StoreVersionError` or :class:`StoreTokenError`.
    """

    def __init__(self, directory: str | os.PathLike[str], token: str | None) -> None:
        self.directory = Path(directory)
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise StateStoreError(f"cannot create the state directory {self.directory}: {exc}; "
                                  "choose a writable directory for --state-dir") from exc  # fmt: skip
        self._lock = _lock_directory(self.directory)
        self.path = self.directory / FILE_NAME
        fresh = not self.path.exists()
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            if fresh:
                os.chmod(self.path, 0o600)  # it holds the token
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            if not fresh:
                self._check_integrity()
            self._db.executescript(_SCHEMA)
            meta = dict(self._db.execute("SELECT k, v FROM meta").fetchall())
        except sqlite3.DatabaseError as exc:
            self._close_quietly()
            raise StoreCorruptError(self._corrupt(exc)) from exc
        if meta:
            self._check_meta(meta, token)
            self.token: str = meta["token"]
            self.address: str = meta.get("address", "")
        else:
            if not token:
                self._close_quietly()
                raise StateStoreError(f"the state directory {self.directory} is new and no token was given; "
                                      "pass the cluster's token (TIDEPOOL_TOKEN) the first time")  # fmt: skip
            self._db.executemany("INSERT INTO meta VALUES (?, ?)",
                                 [("version", str(LAYOUT_VERSION)), ("token", token), ("address", "")])  # fmt: skip
            self.token, self.address = token, ""
        self._queue: queue.Queue[Batch | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None
        self.written = 0  # batches committed (for tests and benchmarks)

    def _check_integrity(self) -> None:
        row = self._db.execute("PRAGMA quick_check").fetchone()
        if row is None or row[0] != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {row[0] if row else 'no answer'}")

    def _corrupt(self, exc: BaseException) -> str:
        return (f"the state store {self.path} is corrupt ({type(exc).__name__}: {exc}); nothing was loaded. "
                "Move the directory aside (it may help a post-mortem) and start the scheduler with a new "
                "--state-dir: finished work is lost, workers re-register empty")  # fmt: skip

    def _check_meta(self, meta: dict[str, str], token: str | None) -> None:
        version = meta.get("version")
        if version != str(LAYOUT_VERSION):
            self._close_quietly()
            raise StoreVersionError(
                f"the state store {self.path} has layout version {version!r}, this tidepool reads version "
                f"{LAYOUT_VERSION}; nothing was loaded. Run the tidepool that wrote it to finish that run, "
                "or start with a new --state-dir")  # fmt: skip
        stored = meta.get("token")
        if not stored:
            self._close_quietly()
            raise StoreCorruptError(self._corrupt(ValueError("no token in its meta table")))
        if token and not hmac.compare_digest(stored.encode(), token.encode()):
            self._close_quietly()
            raise StoreTokenError(
                f"the state store {self.path} belongs to a cluster with another token; nothing was loaded. "
                "Start with that cluster's token (or without one: the store's is used), or use another "
                "--state-dir for this cluster")  # fmt: skip

    def _close_quietly(self) -> None:
        try:
            self._db.close()
        except Exception:  # noqa: BLE001 - already failing with a better error
            pass
        self._lock.close()

    # ---- writing ---------------------------------------------------------------------------------
    def set_address(self, address: str) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('address', ?)", (address,))
        self.address = address

    def submit(self, batch: Batch) -> None:
        """Write ``batch`` on the writer thread (in submission order); never blocks on the disk."""
        if self._error is not None:
            raise StateStoreError(f"writing the state store {self.path} failed: {self._error}") from self._error
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_loop, name="tidepool-state-store", daemon=True)
            self._writer.start()
        self._queue.put(batch)

    def _write_loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                self.write(batch)
            except BaseException as exc:  # noqa: BLE001 - reported by the next submit()
                self._error = exc
                return
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until every submitted batch is committed."""
        if self._writer is not None:
            self._queue.join()

    def write(self, b: Batch) -> None:
        """Apply ``b`` in one transaction (all of it or, after a crash, none of it)."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            if b.clear_tasks:
                db.execute("DELETE FROM tasks")
                db.execute("DELETE FROM wants")
            if b.functions:
                db.executemany("INSERT OR IGNORE INTO functions VALUES (?, ?)",
                               [(fid, pack(blob)) for fid, blob in b.functions.items()])  # fmt: skip
            if b.forgotten:  # first: a key forgotten, then submitted again, is a new row
                db.executemany("DELETE FROM tasks WHERE key = ?", [(k,) for k in b.forgotten])
            if b.new_tasks:
                db.executemany(
                    "INSERT OR REPLACE INTO tasks (key, spec, payload, status, holders, error) VALUES (?, ?, ?, ?, ?, ?)",
                    [(t.key, json.dumps(t.spec), pack(t.payload), t.status, json.dumps(t.holders),
                      _pack_error(t.error)) for t in b.new_tasks])  # fmt: skip
            if b.outcomes:
                db.executemany("UPDATE tasks SET status = ?, holders = ?, error = ? WHERE key = ?",
                               [(s, json.dumps(h), _pack_error(e), k) for k, (s, h, e) in b.outcomes.items()])  # fmt: skip
            if b.wants_added:
                db.executemany("INSERT OR IGNORE INTO wants VALUES (?, ?)", b.wants_added)
            if b.wants_removed:
                db.executemany("DELETE FROM wants WHERE client = ? AND key = ?", b.wants_removed)
            if b.workers_joined:
                db.executemany("INSERT OR REPLACE INTO workers VALUES (?, ?)", b.workers_joined)
            if b.workers_left:
                db.executemany("DELETE FROM workers WHERE id = ?", [(w,) for w in b.workers_left])
            for iid, data in b.instances.items():
                if data is None:
                    db.execute("DELETE FROM instances WHERE id = ?", (iid,))
                else:
                    db.execute("INSERT OR REPLACE INTO instances VALUES (?, ?)", (iid, json.dumps(data)))
            if b.cost is not None:
                db.execute("INSERT OR REPLACE INTO meta VALUES ('cost', ?)", (json.dumps(b.cost),))
            for n, blob in b.setups.items():  # a name registered again moves to the end (a new seq), as
                # in the scheduler
                if blob is None:
                    db.execute("DELETE FROM setups WHERE name = ?", (n,))
                else:
                    db.execute("INSERT OR REPLACE INTO setups (name, blob) VALUES (?, ?)", (n, pack(blob)))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self.written += 1

    # ---- reading ---------------------------------------------------------------------------------
    def load(self) -> Snapshot:
        """Everything, decoded, or a :class:`StoreCorruptError` (then nothing is used)."""
        db = self._db
        try:
            db.execute("BEGIN")
            try:
                rows = db.execute("SELECT key, spec, payload, status, holders, error FROM tasks ORDER BY seq").fetchall()
                funcs = db.execute("SELECT fid, blob FROM functions").fetchall()
                wants = db.execute("SELECT client, key FROM wants").fetchall()
                workers = db.execute("SELECT id, address FROM workers").fetchall()
                instances = db.execute("SELECT id, data FROM instances").fetchall()
                setup_rows = db.execute("SELECT name, blob FROM setups ORDER BY seq").fetchall()
                cost_row = db.execute("SELECT v FROM meta WHERE k = 'cost'").fetchone()
            finally:
                db.execute("COMMIT")
            tasks = [StoredTask(k, json.loads(spec), unpack(payload), status, json.loads(holders),
                                _unpack_error(error)) for k, spec, payload, status, holders, error in rows]  # fmt: skip
            for t in tasks:
                if t.status not in ("p", "m", "e") or not isinstance(t.spec, list) or len(t.spec) < 8:
                    raise ValueError(f"task {t.key!r} has an unreadable record")
            functions = {}
            for fid, blob in funcs:
                ser = unpack(blob)
                assert ser is not None
                functions[fid] = ser
            by_client: dict[str, list[str]] = {}
            for client, key in wants:
                by_client.setdefault(client, []).append(key)
            setups = []
            for name, blob in setup_rows:
                ser = unpack(blob)
                assert ser is not None
                setups.append((str(name), ser))
            return Snapshot(self.address, tasks, functions, by_client, dict(workers),
                            {i: json.loads(d) for i, d in instances}, setups,
                            _cost(cost_row[0]) if cost_row else None)  # fmt: skip
        except (sqlite3.DatabaseError, ValueError, TypeError, struct.error, AssertionError) as exc:
            raise StoreCorruptError(self._corrupt(exc)) from exc

    def size(self) -> int:
        """Bytes on disk (the database and its write-ahead log)."""
        return sum(p.stat().st_size for p in self.directory.glob(FILE_NAME + "*") if p.exists())

    def compact(self) -> None:
        """Fold the write-ahead log into the database and give freed pages back (at close)."""
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=60)
            self._writer = None
        self._db.close()
        self._lock.close()  # the directory is free for the next scheduler
