"""docs/providers.md's TOML tables build the providers they describe (keys = constructor arguments)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from tidepool.config import parse
from tidepool.providers._address import contact_address
from tidepool.providers.local import LocalProvider
from tidepool.providers.slurm import SlurmProvider
from tidepool.providers.ssh import SSHProvider

DOC = Path(__file__).resolve().parent.parent / "docs" / "providers.md"
KINDS = {"local": LocalProvider, "ssh": SSHProvider, "slurm": SlurmProvider}


def toml_blocks() -> list[str]:
    return re.findall(r"```toml\n(.*?)```", DOC.read_text(), re.S)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_documented_toml_builds_the_provider(kind: str) -> None:
    blocks = [b for b in toml_blocks() if re.search(rf'^kind = "{kind}"', b, re.M)]
    assert blocks, f"docs/providers.md has no TOML example for kind = {kind!r}"
    for text in blocks:
        cfg = parse(tomllib.loads(text), f"providers.md ({kind})")
        prov = cfg.make_provider("tcp://0.0.0.0:8786", "t" * 32)
        try:
            assert isinstance(prov, KINDS[kind])
        finally:
            prov.close()


def test_every_documented_provider_key_is_a_constructor_argument() -> None:
    import inspect

    for text in toml_blocks():
        data = tomllib.loads(re.sub(r"^# ?(\w+ = )", r"\1", text, flags=re.M))  # commented keys too
        p = dict(data.get("provider", {}))
        cls = KINDS.get(p.pop("kind", ""))
        if cls is None:
            continue
        params = set(inspect.signature(cls).parameters)
        assert set(p) <= params, f"{cls.__name__}: unknown documented keys {set(p) - params}"


def test_contact_address_replaces_wildcards_and_keeps_the_port() -> None:
    import socket

    assert contact_address("tcp://10.1.2.3:8786") == "tcp://10.1.2.3:8786"
    assert contact_address("tcp://0.0.0.0:8786") == f"tcp://{socket.getfqdn()}:8786"
    assert contact_address("tcp://0.0.0.0:8786", "login1") == "tcp://login1:8786"
    assert contact_address("tcp://127.0.0.1:1", "fe80::1") == "tcp://[fe80::1]:1"
    assert contact_address("memory://x") == "memory://x"
