"""Words of what parastream prints."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word`` agreeing in number: "1 stream", "3 streams", "1 branch", "2 branches" (``many``: an
    irregular plural)."""
    if n == 1:
        return f"{n} {word}"
    if many is None:
        many = word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n} {many}"
