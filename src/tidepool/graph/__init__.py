"""Task graphs: references between tasks and the lazy ``@task`` builder."""

from tidepool.graph.delayed import Delayed, task
from tidepool.graph.refs import Ref, substitute

__all__ = ["Delayed", "Ref", "substitute", "task"]
