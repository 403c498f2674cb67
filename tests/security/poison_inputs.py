"""Inputs that crash a grammar compiler: the poison requests of the containment tests and of
`bench/attack.py`.

llguidance recurses once per link of a chain and overflows its thread's stack: with 8 MiB, at
about 930 `$ref`s each naming an object that holds the next, and at about 2,600 chained Lark
rules (measured with llguidance 1.9).
"""

from __future__ import annotations

from typing import Any


def ref_chain_schema(length: int) -> dict[str, Any]:
    """A JSON schema whose `$defs` form a chain of `length` objects, each holding the next."""
    defs: dict[str, Any] = {
        f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
        for i in range(length)
    }
    defs[f"d{length}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(length: int) -> str:
    """A Lark grammar of `length` rules, each expanding to the next."""
    rules = [f"r{i}: r{i + 1}" for i in range(length)]
    return "\n".join(["start: r0", *rules, f'r{length}: "x"'])


# Chains far past what an 8 MiB stack compiles, and the probe's own sizes.
CRASHING_SCHEMA_LENGTH = 1_000
CRASHING_LARK_LENGTH = 20_000
# Past what the engine's 64 MiB compile thread holds: only a caller with no front end
# (the Python API) can send it.
ENGINE_CRASHING_SCHEMA_LENGTH = 12_000
