"""The engine core and the process around it: `EngineCore`'s step loop (scheduler + executor),
`EngineCoreProc`'s busy loop, its ZMQ IO threads and their CURVE gate, the work items between
them, the rank's side of elastic resizes, and the process entry with its parent watch.

May import every other part of `shoal.engine`; nothing in `model/`, `parallel/`, `kernels/` or the
shared top-level modules imports it.
"""
