"""The C kernels of `csrc/` (paged attention, GGUF-block matmuls): built once per CPU ISA,
cached, and called through ctypes.

Imports nothing else of `shoal.engine`.
"""
