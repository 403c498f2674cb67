"""shoal engine core: wire protocol, scheduler, paged KV cache, model runner, models, EngineCore(Proc). Imports no Ray."""
