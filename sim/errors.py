"""Bad simulator input: one error type that names the offending field and what it accepts."""

from __future__ import annotations

from collections.abc import Iterable

from tokenfleet.runtime.errors import ConfigError


class SimInputError(ConfigError):
    def __init__(self, field: str, message: str, accepted: Iterable[str] | str | None = None):
        if accepted is not None and not isinstance(accepted, str):
            accepted = ", ".join(sorted(accepted))
        text = f"{field}: {message}" + (f" (accepted: {accepted})" if accepted else "")
        super().__init__(text)
        self.field = field
        self._args = (field, message, accepted)

    def __reduce__(self):
        # Rebuilt from its own arguments: a search run in a worker process sends its error back pickled.
        return type(self), self._args
