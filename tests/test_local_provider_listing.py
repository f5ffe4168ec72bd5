"""The local provider lists every worker a launch named, also while the launch is still spawning
processes (the autoscaler may list from another thread meanwhile)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

import tidepool.providers.local as local
from tidepool.providers.local import LocalProvider
from tidepool.scaling.node_types import NodeType


def test_workers_not_spawned_yet_are_listed_as_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old listing missed them, and the controller gave them up as "not listed by the provider
    any more" 7 ms after the launch, then launched replacements: 5 workers on a maximum of 4."""
    provider = LocalProvider("tcp://127.0.0.1:9", "t" * 32, fork_server=False)  # the spawning path
    nt = NodeType("cpu-big", {"cpu": 1})
    ids = provider.worker_ids(nt, 3, "a1")
    seen: list[dict[str, Any]] = []
    real = subprocess.Popen

    def popen_seeing_the_listing(cmd: Any, **kw: Any) -> Any:
        seen.append(provider.list())  # what a concurrent list() sees while this one spawns
        return real(["true"], **kw)

    monkeypatch.setattr(local.subprocess, "Popen", popen_seeing_the_listing)
    provider.launch(nt, 3, "a1")
    try:
        assert len(seen) == 3
        for listing in seen:
            assert set(ids) <= set(listing) and all(listing[w]["alive"] for w in ids if w not in provider.procs)
        assert seen[0][ids[2]] == {"node_type": "cpu-big", "request_id": "a1", "alive": True,
                                   "returncode": None, "state": "starting"}  # fmt: skip
    finally:
        provider.close()
