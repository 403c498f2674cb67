"""Compute: the executor and its worker, the model runner, the models (Llama family, Qwen2,
Mixtral) and their layers, paged attention behind its backends, and the sampler.

Imports the shared top-level modules, `loader/`, `kernels/` and `parallel/`; never `core/`.
"""
