"""One kind of error for every layer: what went wrong with a request, as data, never as an HTTP
status. The engine and its adapter code say which `ErrorKind` a failure is; the ingress alone
maps a kind to an HTTP status and an OpenAI error type (`app/protocol.py`). Plain Python: no
torch, no Ray.

`ServingError` is the exception form. Its state lives on the instance, never on the class: a
pickled copy is rebuilt from its message and then given its `__dict__` back, and Ray's wrapper
of an error raised in a replica reads attributes it lacks from the error, so a class-level
default would shadow the error's own kind. `EngineError` in `replicas/protocol.py` is the data
form a request's stream carries.
"""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    INVALID = "invalid"  # the request or the adapter is wrong: the client must change it
    NOT_FOUND = "not_found"  # the model or adapter named is not served (or no longer)
    UNAVAILABLE = "unavailable"  # cannot be served now (the hub, a replica): retry later
    INTERNAL = "internal"  # a failure of ours: its details go to the log only


class ServingError(Exception):
    """A request or an adapter that cannot be served, and why (`kind`, the class's own when
    not given). `param` names the request field at fault (OpenAI's error `param`); `code` is
    OpenAI's error code, when it has one."""

    default_kind = ErrorKind.INVALID

    def __init__(
        self,
        message: str,
        kind: ErrorKind | None = None,
        *,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind if kind is not None else self.default_kind
        self.param = param
        self.code = code
