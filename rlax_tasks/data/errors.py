"""The error a dataset value raises when it does not fit its field (the caller names the row)."""

from __future__ import annotations


class FieldError(ValueError):
    """A raw value that does not fit its field; ``field`` names the input column when known."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field
