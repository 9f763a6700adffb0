"""Pipelines: the domain logic of each pipeline as stage handlers (added with the runner)."""
