"""The server's queue, request size and shutdown limits: `peregrine serve`'s option defaults (server/cli.py) and
create_app's (server/app.py), in a module that imports nothing."""

DEFAULT_MAX_QUEUE = 256  # waiting requests before 429: ~a minute of backlog at small batch
DEFAULT_DRAIN_S = 60.0  # SIGTERM waits this long for in-flight requests before cutting them
DEFAULT_MAX_BODY_BYTES = 64 << 20  # a request body larger than this is a 413, refused before it is read whole
