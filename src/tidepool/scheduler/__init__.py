"""The scheduler: a pure state machine (``state.py``) and its asyncio shell (``server.py``)."""
