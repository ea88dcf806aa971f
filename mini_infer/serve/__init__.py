"""The OpenAI-compatible server (chapter 6): request schemas, the engine's asyncio
loop, Prometheus metrics and the FastAPI app."""
