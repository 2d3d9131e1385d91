"""The error a request's parameters raise, apart so that every module checking them can name it."""

from __future__ import annotations


class InvalidParameterError(ValueError):
    """A request parameter is out of range; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
