"""Parallelism across ranks: the process groups, expert placement and its all-to-all exchange,
DP waves, and the state of an elastic resize.

Imports the shared top-level modules and `loader/` only: neither `model/` nor `core/`.
"""
