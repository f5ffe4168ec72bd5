"""Token files: written for their owner only, never through a symbolic link, and refused when
others may read them (issue 16)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tidepool.comm import auth
from tidepool.errors import ConfigError

pytestmark = pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")


def mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_an_existing_world_readable_file_ends_owner_only(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("old old old old")
    f.chmod(0o644)
    auth.write_token_file(str(f), "new")
    assert mode(f) == 0o600 and f.read_text() == "new"  # shorter than before: truncated
    assert auth.read_token_file(str(f)) == "new"


def test_a_new_file_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        auth.write_token_file(str(tmp_path / "t"), "x")
    finally:
        os.umask(old)
    assert mode(tmp_path / "t") == 0o600


def test_a_symlinked_token_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("do not overwrite")
    link = tmp_path / "token"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        auth.write_token_file(str(link), "secret")
    assert target.read_text() == "do not overwrite"


def test_a_token_file_others_can_read_is_refused_with_the_fix(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("abc\n")
    f.chmod(0o644)
    with pytest.raises(ConfigError, match=r"chmod 600 .*token"):
        auth.read_token_file(str(f))
    f.chmod(0o640)
    with pytest.raises(ConfigError, match="other users"):
        auth.read_token_file(str(f))
    f.chmod(0o600)
    assert auth.read_token_file(str(f)) == "abc"


def test_the_scheduler_command_writes_through_the_safe_writer(tmp_path: Path) -> None:
    """`tidepool scheduler --token-file` and the Slurm provider's token file use write_token_file."""
    from tidepool.providers.slurm import SlurmProvider

    link = tmp_path / "tok"
    link.symlink_to(tmp_path / "elsewhere")
    p = SlurmProvider(token_file=str(link))
    with pytest.raises(ConfigError, match="symbolic link"):
        p.bind("tcp://127.0.0.1:1", "secret")
    assert not (tmp_path / "elsewhere").exists()
