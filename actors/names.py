"""The names the control actors take in a cluster's Ray namespace: how any process finds them."""

from __future__ import annotations

REGISTRY_NAME = "shoal-registry"
COORDINATOR_NAME = "shoal-coordinator"
OWNER_NAME = "shoal-owner"
AUTOSCALER_NAME = "shoal-autoscaler"
