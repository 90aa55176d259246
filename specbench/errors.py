"""The one exception a user's mistake raises: checked before any model loads, reported in one line."""


class ConfigError(ValueError):
    """Bad user input, reported in one line before any model loads."""
