"""Elastic scaling: node types, snapshots, policies, the planner and the controller."""
