"""The node's OpenAI-compatible HTTP API (docs/http-api.md): request bodies to `generate`s (`requests`),
responses and SSE chunks (`responses`), errors in vLLM's shape (`errors`), Prometheus metrics
(`metrics`), the Starlette routes (`app`) and hypercorn's Trio worker serving them (`server`).
"""
