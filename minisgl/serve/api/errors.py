"""The client error every route raises, with the HTTP status and the field it names."""

from __future__ import annotations


class BadRequest(ValueError):
    """A client error; ``status`` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param
