"""Routing over a cluster's ranks: `DPLBAsyncMPClient`, the request router, the policies, the
KV-cache index, request migration, and the `ClusterLink` that keeps a client in step with a
running cluster's registry.

Builds on `transport/`; imports nothing of `api/`. Only `cluster_link` speaks Ray.
"""
