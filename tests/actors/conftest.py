"""Fixtures of the actor tests: a module-scoped local Ray."""

from __future__ import annotations

from tests.ray_utils import ray_local

__all__ = ["ray_local"]
