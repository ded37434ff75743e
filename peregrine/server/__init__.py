"""OpenAI-compatible HTTP server with Prometheus metrics (FastAPI + uvicorn).

Imported lazily: the CLI and the engine work where fastapi/uvicorn are absent."""


def __getattr__(name):
    if name in ("BackgroundServer", "create_app"):
        from . import app
        return getattr(app, name)
    raise AttributeError(name)


__all__ = ["BackgroundServer", "create_app"]
