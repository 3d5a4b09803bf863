"""Errors a request can cause, shared by every layer that validates one (the API routes, the
structured-output compiler, the engines). Plain Python: importing them costs nothing."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request parameter is out of range. `param` names it; the message gives the limit."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


class RequestTooLongError(InvalidRequestError):
    """The request can never fit (context length or the whole KV cache)."""
