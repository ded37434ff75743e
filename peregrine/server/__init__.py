"""OpenAI-compatible HTTP server with Prometheus metrics (FastAPI + uvicorn)."""
from .app import BackgroundServer, create_app

__all__ = ["BackgroundServer", "create_app"]
