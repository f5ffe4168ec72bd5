"""Providers start and stop workers: local processes, callbacks, SSH, Slurm."""

from tidepool.providers.local import LocalProvider

__all__ = ["LocalProvider"]
