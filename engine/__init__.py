"""The engine: one data-parallel rank's serving loop. Imports no Ray.

- `kernels/`: the C kernels;
- top level and `loader/` (shared by everything below and by the clients): the wire protocol
  and its codec (`protocol`, `serial`), `config`, `errors`, requests and the scheduler, the
  paged KV cache (`kv_cache`, `block_pool`, `block_hash`, `kv_events`), tokenizing, structured
  outputs, and reading checkpoint files (`loader/`: safetensors, GGUF, their configs);
- `parallel/`: process groups, expert parallelism, DP waves, elastic state;
- `model/`: executor, worker, model runner, models, attention, sampler;
- `core/`: `EngineCore`, `EngineCoreProc` and the process's IO.

Each imports only what is listed before it (`tests/test_layering.py`); the scheduler and the KV
cache import no torch.
"""
