"""The error a user's mistake raises: the CLI prints it as one "error:" line, the server as a 400."""


class ConfigError(ValueError):
    """A user-facing configuration problem (bad file, field, preset or option)."""
