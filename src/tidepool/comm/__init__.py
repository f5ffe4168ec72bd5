"""Networking: frames, serialisation, authentication and transports (TCP and in-memory)."""

from tidepool.comm.core import Connection, Listener, connect, listen
from tidepool.comm.serialize import Serialized, deserialize, serialize

__all__ = ["Connection", "Listener", "Serialized", "connect", "deserialize", "listen", "serialize"]
