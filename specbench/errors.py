"""The one exception a user's mistake raises: checked before any model loads, reported in one line."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """Bad user input, reported in one line before any model loads."""


def did_you_mean(word, choices) -> str:
    """`` did you mean X?`` with X the choice ``word`` is in another case, else the closest (difflib),
    or "" when none is close."""
    choices = [str(c) for c in choices]
    best = [c for c in choices if c.lower() == str(word).lower()] or difflib.get_close_matches(str(word), choices, n=1)
    return f" did you mean {best[0]}?" if best else ""


def unknown_key(key: str, keys, owner: str, at: int = -1, moved: str | None = None) -> ConfigError:
    """The error for a key ``owner`` (``pld's``, ``top-level``) does not declare: the key as
    written, the closest declared key written the same way, and every declared one (``name`` is
    chosen by its group). ``at``: which of the key's dotted parts is undeclared (the last).
    ``moved``: the key it is now (``temperature`` -> ``sampling.temperature``), suggested instead."""
    keys = [k for k in keys if k != "name"]
    parts = key.split(".")
    at = at % len(parts)
    prefix, last = ".".join(parts[:at]), parts[at]
    # a key it begins (draft -> draft_model), else the closest; suggested as written: pld.max_ngram
    best = [k for k in map(str, keys) if k.startswith(last + "_")][:1] or difflib.get_close_matches(last, map(str, keys), n=1)
    best = [moved + "".join("." + p for p in parts[at + 1:])] if moved else best
    hint = f" did you mean {prefix + '.' if prefix and not moved else ''}{best[0]}?" if best else ""
    return ConfigError(f"unknown key {key};{hint} {owner} keys: {', '.join(keys) or 'none'}")
