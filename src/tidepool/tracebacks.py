"""Traceback objects rebuilt from a worker's formatted traceback (``Future.traceback()``).

Stateless.  Data flow: a task that raised on a worker comes back as its exception with the worker's
formatted traceback attached as text (a :class:`~tidepool.errors.RemoteTraceback` in
``__cause__``); frames are never pickled.  :func:`rebuild` turns that text into a real chain of
traceback objects, one per remote frame, each pointing at the remote file, line and function, so
the standard ``traceback`` module (``print_tb``, ``format_tb``, ``extract_tb``) and debuggers that
read them work as they do in Dask.  The frames hold no remote locals.
"""

from __future__ import annotations

import linecache
import re
import types

from tidepool.errors import RemoteTraceback

_FRAME = re.compile(r'^  File "(?P<file>.*)", line (?P<line>\d+), in (?P<name>.+)$')


class _Here(Exception):
    """Raised inside a made-up frame to capture a traceback entry for it."""


def frames(text: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of every frame in a formatted traceback, outermost first (the frames
    of chained exceptions' tracebacks, if any, are left out: only the last traceback's count)."""
    found: list[tuple[str, int, str]] = []
    for line in text.splitlines():
        if line.startswith("Traceback (most recent call last)"):
            found = []  # a chained exception's traceback came first: the raised one is the last
            continue
        m = _FRAME.match(line)
        if m:
            found.append((m["file"], int(m["line"]), m["name"]))
    return found


def _entry(file: str, line: int, name: str) -> types.TracebackType:
    """A traceback entry whose frame is at ``file``:``line`` in a function named ``name``."""
    code = compile("\n" * (max(line, 1) - 1) + _statement(file, line), file, "exec").replace(co_name=name)
    try:
        exec(code, {"_Here": _Here, "__name__": "__remote__"})  # noqa: S102 - compiled here, raises at once
    except _Here as raised:
        tb = raised.__traceback__
        assert tb is not None and tb.tb_next is not None
        return tb.tb_next  # the made-up frame (tb is this function's own)
    raise AssertionError("unreachable")  # pragma: no cover


def _statement(file: str, line: int) -> str:
    """``raise _Here``, spread over the whole of that source line where this machine has the file,
    so that the traceback module shows the line without marking a made-up part of it."""
    source = linecache.getline(file, line).rstrip()
    body = source.lstrip()
    plain = "raise (_Here)"
    if len(body) <= len(plain):
        return plain
    return "raise (" + " " * (len(body) - len(plain)) + "_Here)"


def rebuild(text: str) -> types.TracebackType | None:
    """The chain of traceback entries that ``text`` (a formatted traceback) describes, or None if it
    names no frame."""
    tb: types.TracebackType | None = None
    for file, line, name in reversed(frames(text)):
        entry = _entry(file, line, name)
        tb = types.TracebackType(tb, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return tb


def of_exception(exc: BaseException) -> types.TracebackType | None:
    """The remote traceback of a task's exception as traceback objects; for an error raised here
    (no remote text), the exception's own traceback."""
    cause = exc.__cause__
    if isinstance(cause, RemoteTraceback):
        tb = rebuild(cause.tb)
        if tb is not None:
            return tb
    return exc.__traceback__
