"""User entry points: the shoal CLI, the ray job entrypoint, the OpenAI-compatible HTTP front end
(`deploy/openai`) with its Prometheus metrics (`deploy/metrics.py`) and Grafana dashboard, the
demo."""
