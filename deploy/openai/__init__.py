"""The OpenAI-compatible HTTP front end: a FastAPI app over one `AsyncLLM` attached to a cluster.

`app.build_app` makes the app; `server` runs it with uvicorn, in `shoal serve --port` or as
`shoal api-server --namespace NS`, attached to a running cluster.
"""
