"""Code and environment on every worker: setup specs built on the client, run on each worker.

A :class:`SetupSpec` is built by ``client.register_setup`` and travels pickled (the scheduler stores
and forwards it without unpickling).  The scheduler keeps the ordered list of specs; every worker
runs all of them when it registers, before it takes its first task (its state is ``starting``
until then), and a spec registered later runs on every current worker before any task submitted
after it.  On the worker, :func:`run_setup` applies, in order: environment variables, files (into
a per-worker directory named by ``$TIDEPOOL_FILES``), local modules/packages (unpacked into a
per-worker directory put first on ``sys.path``, then imported), pip requirements (``python -m
pip install``), and finally the user's function.  Any failure raises :class:`WorkerSetupError`
carrying the traceback; the worker reports it and is not given tasks.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from tidepool.errors import ConfigError, WorkerSetupError

PIP_TIMEOUT = 900.0


def setup_digest(blob: Any) -> str:
    """A registered setup's content (its pickle), to tell which setups a worker has run: the
    scheduler sends a rejoining worker those it has not."""
    h = hashlib.blake2b(digest_size=16)
    for part in (getattr(blob, "data", blob), *getattr(blob, "buffers", ())):
        h.update(part if isinstance(part, (bytes, bytearray, memoryview)) else repr(part).encode())
    return h.hexdigest()


@dataclass
class SetupSpec:
    name: str
    #: the function run last, pickled on its own (cloudpickle): unpickled on the worker only after
    #: the modules step, so it may come from a module shipped by the same call
    fn: bytes | Callable[[], Any] | None = None
    fn_name: str = ""
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    modules: list[str] = field(default_factory=list)
    archive: bytes = b""  # zip of the modules' sources, paths relative to their sys.path entry
    requirements: list[str] = field(default_factory=list)
    pip_args: list[str] = field(default_factory=list)


def pack_modules(names: Iterable[str]) -> bytes:
    """Zip the sources of importable local modules/packages (as the client sees them)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name in names:
            spec = importlib.util.find_spec(name)
            if spec is None or spec.origin in (None, "built-in", "frozen"):
                raise ConfigError(f"cannot ship module {name!r}: it is not importable here as a source file")
            top = name.split(".")[0]
            if "." in name:  # a module or package inside another: its parent's __init__ would be missing
                raise ConfigError(f"ship the package {top!r} instead of {name!r} (the workers need the whole package)")
            if spec.submodule_search_locations:  # a package: ship the whole directory
                pkg_dir = Path(next(iter(spec.submodule_search_locations)))
                root = pkg_dir.parents[len(name.split(".")) - 1]
                for path in sorted(pkg_dir.rglob("*")):
                    if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".so"):
                        zf.write(path, str(path.relative_to(root)))
            else:
                origin = Path(spec.origin)  # type: ignore[arg-type]
                if origin.suffix != ".py":
                    raise ConfigError(f"cannot ship module {name!r}: {origin} is not a .py file")
                zf.write(origin, origin.name)
    return buf.getvalue()


def build_spec(name: str, fn: Callable[[], Any] | None = None, *, modules: Iterable[str] = (),
               files: Iterable[str] = (), requirements: Iterable[str] = (),
               env: dict[str, str] | None = None, pip_args: Iterable[str] = ()) -> SetupSpec:  # fmt: skip
    if fn is not None and not callable(fn):
        raise ConfigError(f"register_setup: {fn!r} is not callable")
    blobs: dict[str, bytes] = {}
    for f in _items(files, "files"):
        p = Path(f)
        if p.name in blobs:
            raise ConfigError(f"register_setup: two files are named {p.name!r} ({f!r} and another); workers keep "
                              "files by name: rename one, or put them in a directory you ship as a module")  # fmt: skip
        try:
            blobs[p.name] = p.read_bytes()
        except OSError as exc:
            raise ConfigError(f"register_setup: cannot read file {f!r}: {exc}") from exc
    mods = _items(modules, "modules")
    for k, v in (env or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ConfigError(f"register_setup: env must map str to str, got {k!r}: {v!r}")
    fn_blob = cloudpickle.dumps(fn, protocol=5) if fn is not None else None
    return SetupSpec(name, fn_blob, str(getattr(fn, "__name__", fn or "")), dict(env or {}), blobs, mods,
                     pack_modules(mods) if mods else b"", _items(requirements, "requirements"),
                     _items(pip_args, "pip_args"))  # fmt: skip


def _items(value: Iterable[str] | str, what: str) -> list[str]:
    """A list of strings; one string is one item (``requirements="numpy"``), not its letters."""
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    if isinstance(value, bytes):
        raise ConfigError(f"register_setup: {what} takes strings, got bytes {value!r:.60}")
    return [os.fspath(v) if isinstance(v, os.PathLike) else str(v) for v in value]


def run_setup(spec: SetupSpec, workdir: Path) -> None:
    """Apply one spec in this process; raises WorkerSetupError with what went wrong."""
    step = "environment"
    try:
        os.environ.update(spec.env)
        if spec.files:
            step = "files"
            fdir = workdir / "files"
            fdir.mkdir(parents=True, exist_ok=True)
            for fname, data in spec.files.items():
                (fdir / fname).write_bytes(data)
            os.environ["TIDEPOOL_FILES"] = str(fdir)
        if spec.archive:
            step = f"modules {spec.modules}"
            # each version in a directory of its own: a version shipped before stays whole for tasks
            # importing from it meanwhile, and none of its files (a module the new one deleted, a
            # package it turned into a module, stale bytecode) can shadow the new one
            root = workdir / "code" / spec.name
            code = root / hashlib.blake2b(spec.archive, digest_size=8).hexdigest()
            if not code.is_dir():
                part = root / f".{code.name}.{os.getpid()}"
                shutil.rmtree(part, ignore_errors=True)
                part.mkdir(parents=True)
                with zipfile.ZipFile(io.BytesIO(spec.archive)) as zf:
                    zf.extractall(part)
                part.rename(code)
            prefix = str(root) + os.sep
            sys.path[:] = [p for p in sys.path if not p.startswith(prefix)]  # earlier versions off
            sys.path.insert(0, str(code))  # first, also ahead of another setup shipping the same module
            importlib.invalidate_caches()
            for m in spec.modules:  # imported afresh with its submodules (reload() did the top only)
                for name in [n for n in list(sys.modules) if n == m or n.startswith(m + ".")]:
                    sys.modules.pop(name, None)
                importlib.import_module(m)
        if spec.requirements:
            step = f"pip install {' '.join(spec.requirements)}"
            cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q",
                   *spec.pip_args, *spec.requirements]  # fmt: skip
            try:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT)
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"pip did not finish within {PIP_TIMEOUT:.0f}s") from exc
            if r.returncode != 0:
                raise RuntimeError(f"pip exited with {r.returncode}:\n{(r.stderr or r.stdout)[-4000:]}")
            importlib.invalidate_caches()
        if spec.fn is not None:
            step = f"function {spec.fn_name or getattr(spec.fn, '__name__', spec.fn)!r}"
            fn = cloudpickle.loads(spec.fn) if isinstance(spec.fn, bytes) else spec.fn  # after the modules
            fn()
    except (Exception, SystemExit) as exc:  # sys.exit() in a setup (argparse, a script's main) is its failure
        raise WorkerSetupError(f"setup {spec.name!r} failed at {step}: {type(exc).__name__}: {exc}") from exc


def setup_file(name: str) -> str:
    """Path on this worker of a file shipped with ``register_setup(files=[...])``."""
    d = os.environ.get("TIDEPOOL_FILES")
    if not d:
        raise ConfigError("no files were shipped to this worker (register_setup(files=[...]))")
    return os.path.join(d, name)
