"""Fixtures of the cluster tests: a module-scoped local Ray, or a `ray start --head` node."""

from __future__ import annotations

from tests.ray_utils import ray_head, ray_local

__all__ = ["ray_head", "ray_local"]
