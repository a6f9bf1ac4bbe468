"""`SpaceError`, the one error of loading or resolving a search space, and its one-line message."""

from __future__ import annotations

from typing import NoReturn


class SpaceError(ValueError):
    """A search space that cannot be loaded or resolved; the message is one line naming the file,
    the field and the fix."""


def sentence(message: object) -> str:
    """`message` ending as a sentence does."""
    text = str(message)
    return text if text.endswith((".", "?")) else f"{text}."


def fail(source: str, message: str) -> NoReturn:
    raise SpaceError(f"{source}: {sentence(message)}")
