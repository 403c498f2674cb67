"""What users call: `LLM`, `AsyncLLM`, the prompt forms, output processing (detokenizing, stop
strings, `RequestOutput`) and the `n > 1` fan-out. Builds on `transport/` and `routing/`.
"""
