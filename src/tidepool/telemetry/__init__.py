"""Seeing what the cluster did: the event journal, progress bars, timelines."""
