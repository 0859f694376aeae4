"""The few domain errors. Each says what the caller did wrong; the service maps them to 4xx.

Anything else raised by the engine is our bug and becomes a logged 500.
"""

from __future__ import annotations


class WhitneyError(Exception):
    """Base of the errors a caller can cause. `code` is a stable machine-readable name."""

    code = "error"

    def __init__(self, message: str, *, field: str | None = None, datum_index: int | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.datum_index = datum_index

    def to_dict(self) -> dict:
        out = {"code": self.code, "message": self.message}
        if self.field is not None:
            out["field"] = self.field
        if self.datum_index is not None:
            out["datum_index"] = self.datum_index
        return out


class InvalidInput(WhitneyError):
    """A value breaks a rule: wrong shape, out of range, unknown name."""

    code = "invalid_input"


class NotFound(WhitneyError):
    """A named thing (run, model, checkpoint, sampler version) does not exist."""

    code = "not_found"


class TooLarge(WhitneyError):
    """The request asks for more than this server allows at once (a stated, operator-set limit)."""

    code = "too_large"


class Conflict(WhitneyError):
    """The request is valid alone but clashes with existing state."""

    code = "conflict"


class Unavailable(WhitneyError):
    """What the request needs is briefly out of service (a worker restarting after a failure): retry soon."""

    code = "unavailable"


def check(condition: bool, message: str, *, field: str | None = None, datum_index: int | None = None) -> None:
    """Raise InvalidInput(message) unless condition holds."""
    if not condition:
        raise InvalidInput(message, field=field, datum_index=datum_index)
