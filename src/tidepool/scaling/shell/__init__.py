"""The shells around the pure scaling controller: one shared round (``round.py``) and its
synchronous form; the asyncio shell is ``scaling/autoscaler.py``, the simulator's ``sim/shell.py``."""
