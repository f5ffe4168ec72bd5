"""``python -m tidepool.worker ADDRESS`` (the same as ``tidepool worker ADDRESS``).

It parses the worker's options only (:func:`tidepool.cli.worker_main`), so a worker process imports
the worker and the wire code and nothing else: no client, cluster, scheduler, Dask layer, dashboard
or simulator (``tests/test_worker_imports.py`` guards this set).
"""

from tidepool.cli import worker_main

if __name__ == "__main__":
    import sys

    raise SystemExit(worker_main(sys.argv[1:]))
