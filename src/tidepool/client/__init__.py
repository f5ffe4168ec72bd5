"""The client: submit work, hold futures, gather results.

Layers, bottom up (each imports only those below it):

- ``protocol`` — the sans-IO core: futures table, ordered outbox, ``receive(message) -> events``,
  the fetch plan.  No sockets, no threads; tested by feeding it messages.
- ``connection`` — the shell around it: loop thread, scheduler socket, workers' data ports; the
  owner every future talks to (:class:`~tidepool.futures.FutureOwner`).
- ``specs`` (task specs), ``executor`` (``get_executor()``), ``cluster_calls`` (Dask-named calls),
  ``current`` (``default_client``/``get_client``), and ``api`` — the :class:`Client` facade.

``tidepool.futures``, ``tidepool.waiting``, ``tidepool.graph`` and the worker sit below the client
and never import it; the Dask layer (``tidepool.dask``) sits beside it and uses its public API.
"""

from tidepool.client.api import Client
from tidepool.client.cluster_calls import fire_and_forget, futures_of
from tidepool.client.current import default_client, get_client, worker_client
from tidepool.client.executor import ClientExecutor
from tidepool.client.protocol import FETCH_ATTEMPTS

__all__ = ["FETCH_ATTEMPTS", "Client", "ClientExecutor", "default_client", "fire_and_forget", "futures_of", "get_client",
           "worker_client"]  # fmt: skip
