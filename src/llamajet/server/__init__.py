"""The OpenAI-compatible HTTP server (``llamajet serve``): app.py (routes,
admission, errors), protocol.py (request shapes), grammar.py (structured
output), tools.py (tool calls), metrics.py (Prometheus), run.py (uvicorn and
the graceful drain). Needs the ``server`` extra: fastapi, uvicorn,
prometheus_client, llguidance."""
