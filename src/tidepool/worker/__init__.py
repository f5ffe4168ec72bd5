"""Worker processes: run tasks in slots, keep results, serve them to peers."""

from tidepool.worker.server import Worker

__all__ = ["Worker"]
