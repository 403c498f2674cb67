"""User entry points: the shoal CLI, the ray job entrypoint, the OpenAI-compatible server, metrics, demo."""
