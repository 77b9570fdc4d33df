"""User-facing errors: the CLI prints them as one line and exits with code 2."""

from __future__ import annotations


class SyncdropError(Exception):
    """Bad input from the user (argument, file or model) with a message that names the problem.

    ``field``: the library argument at fault (``"device"``, ``"plan"``, ``"tp"``...), when the
    message is about one. The message is then written to follow the field's name ("must be one of
    ..., got 'x'", "cuda:3: this machine has 1 CUDA device"), and the caller puts the name in front
    in its own terms: the CLI maps the field to its flag (``--device must be ...``), the library
    message reads ``device must be ...``. :meth:`named` renders it with a given name."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message, self.field = message, field

    def named(self, name: str | None = None) -> str:
        """The message prefixed by ``name`` (default: the field itself) when there is a field."""
        if self.field is None:
            return self.message
        return f"{name or self.field} {self.message}"

    def __str__(self) -> str:
        return self.named()
