"""Dask collections on tidepool: ``client.get`` (Dask's scheduler protocol), ``persist`` and
``compute`` of ``dask.array`` / ``dask.dataframe`` / ``dask.bag`` / ``dask.delayed`` values.

Dask is an optional extra (``pip install 'tidepool[dask]'``); nothing here imports it until a Dask
graph arrives.  ``convert`` turns graphs into tidepool tasks on the client, ``run`` is what
workers execute (part of tidepool, so nothing needs shipping), ``client`` is the ``Client`` mixin.
"""

from tidepool.dask.client import DaskCollections, is_dask_collection
from tidepool.dask.convert import require_dask

__all__ = ["DaskCollections", "is_dask_collection", "require_dask"]
