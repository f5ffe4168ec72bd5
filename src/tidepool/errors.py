"""The tidepool error hierarchy.

Every error tidepool raises on purpose derives from :class:`TidepoolError`, and every message says
what happened *and* what to do about it.  The tree::

    TidepoolError
    ├── ConfigError                 bad arguments, cluster files, resources, addresses
    │   └── CycleError              a task graph that depends on itself
    ├── CommError                   network level problems
    │   ├── AuthenticationError     the peer does not know our token (or we do not know theirs)
    │   ├── ProtocolError           a malformed frame; only that connection is closed
    │   │   └── FrameTooLargeError  a frame above the configured size limit
    │   └── ConnectionLostError     the peer went away while we waited for it
    ├── SchedulerError              the scheduler refused a request (unknown key, closed, ...)
    ├── TaskError                   a task could not produce its result
    │   ├── RemoteTaskError         the task raised, and its exception could not be re-created here
    │   ├── KilledWorkerError       the task took its worker down too many times
    │   ├── InfeasibleTaskError     no worker and no node type can ever satisfy its resources
    │   ├── DependencyError         a task it depends on failed
    │   ├── TaskCancelledError      the result was released or cancelled before it was computed
    │   ├── SerializationError      its value cannot be pickled, unpickled or sent
    │   │   ├── ResultTooLargeError its value is over the frame size limit
    │   │   └── UnpicklableError    a submitted function or argument cannot be pickled (also a TypeError)
    │   ├── TransferError           an input could not be moved to the worker that needs it
    │   └── KeyCollisionError       its key is taken by a different live task
    ├── WorkerSetupError            a setup hook failed on a worker
    ├── ProviderError               a provider could not launch/stop/list workers
    └── StateStoreError             a scheduler's state directory cannot be used (nothing loaded)
        ├── StoreCorruptError       the store's file is damaged
        ├── StoreVersionError       the store was written by another tidepool store version
        └── StoreTokenError         the store belongs to a cluster with another token

A task's own exception (say ``ValueError``) is re-raised on the client as itself, with the remote
traceback attached as ``__cause__`` (a :class:`RemoteTraceback`).
"""

from __future__ import annotations


class TidepoolError(Exception):
    """Base class of every error tidepool raises on purpose."""


class ConfigError(TidepoolError, ValueError):
    """Invalid configuration or arguments: fix the call or the cluster file named in the message."""


class CycleError(ConfigError):
    """A task graph contains a cycle (a task that depends, directly or not, on itself)."""


class CommError(TidepoolError, ConnectionError):
    """A network-level problem talking to a scheduler, worker or client."""


class AuthenticationError(CommError):
    """The peer failed the HMAC challenge: both sides must use the same token."""


class ProtocolError(CommError):
    """A malformed or unexpected frame; the connection that sent it is closed."""


class FrameTooLargeError(ProtocolError):
    """A frame larger than the configured limit (``max_frame_bytes``)."""


class ConnectionLostError(CommError):
    """The peer closed the connection or stopped answering."""


class PeerSilentError(ConnectionLostError):
    """A peer sent nothing for the fetch timeout without closing its socket (frozen, or cut off by
    the network).  Its copies are treated as suspect and recomputed or fetched elsewhere; raise
    ``TIDEPOOL_FETCH_TIMEOUT`` if transfers legitimately stall that long."""


class SchedulerError(TidepoolError):
    """The scheduler refused a request."""


class TaskError(TidepoolError):
    """A task could not produce its result."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class RemoteTaskError(TaskError):
    """A task raised an exception that could not be re-created on the client.

    ``remote_type`` holds the exception's type name and ``remote_traceback`` its formatted traceback.
    """

    def __init__(
        self, message: str, key: str | None = None, remote_type: str = "", remote_traceback: str = ""
    ) -> None:
        super().__init__(message, key)
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class KilledWorkerError(TaskError):
    """A task was running on workers that died ``allowed_failures + 1`` times; it is not retried again."""


class InfeasibleTaskError(TaskError):
    """No current worker and no configured node type has the resources this task asks for."""


class DependencyError(TaskError):
    """A task this one depends on failed, so this one cannot run."""


class TaskCancelledError(TaskError):
    """The task was cancelled or its result released before it finished."""


class SerializationError(TaskError):
    """A task's value (or an input) cannot be pickled, unpickled, or sent; it is not recomputed.

    Return values that pickle (``cloudpickle``), or hold them on the worker and return a summary.
    """


class ResultTooLargeError(SerializationError):
    """A task's value is over the frame size limit; return something smaller, or write it to shared
    storage and return its path."""


class UnpicklableError(SerializationError, TypeError):
    """``submit``/``map``/``compute`` was given a function or an argument that cannot be pickled (a
    lock, an open file, a connection); nothing of that call was sent.  Create such objects inside the
    task and pass what builds them.  Also a ``TypeError``, which is what Dask raises here."""


class TransferError(TaskError):
    """An input could not be fetched from a live worker holding it, several times in a row."""


class KeyCollisionError(TaskError, ValueError):
    """A task was submitted under a key a *different* live task already uses.

    The same task (function, arguments, inputs) under the same key shares the first one's result;
    anything else needs its own key, or the first task's futures released first.
    """


class WorkerSetupError(TidepoolError):
    """A setup hook (``register_setup``) failed on a worker; that worker takes no tasks."""


class ProviderError(TidepoolError):
    """A provider failed to launch, stop or list workers; ``request_id``/``worker_ids`` say which."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


class StateStoreError(TidepoolError):
    """A scheduler's state directory (``--state-dir``) cannot be used; nothing of it was loaded."""


class StoreInUseError(StateStoreError):
    """Another scheduler holds the state directory (its lock): stop it first, or use another one."""


class StoreCorruptError(StateStoreError):
    """The state store's file is damaged (not a torn tail, which is dropped silently)."""


class StoreVersionError(StateStoreError):
    """The state store was written by a tidepool whose store layout differs from this one's."""


class StoreTokenError(StateStoreError):
    """The state store belongs to a cluster with another token (another cluster's directory)."""


class RemoteTraceback(Exception):
    """Carries the formatted traceback of an exception raised on a worker (set as ``__cause__``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\nRemote traceback (on the worker):\n{self.tb}"""'
