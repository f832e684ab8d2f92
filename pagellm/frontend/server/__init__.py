"""The OpenAI-compatible HTTP server (`pagellm serve`): FastAPI routes over `AsyncLLM`.

Needs the `serve` extra (fastapi, uvicorn, prometheus_client); nothing else in the
frontend imports this package.
"""
