"""Typed errors for problems a user can fix.

Each carries a message that names the offending field or file and says what to do. The CLI turns
any `TandemError` into that message on stderr and exit code 2; library callers catch the subclass.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base class for user-facing errors (bad input, not bugs)."""


class ConfigError(TandemError, ValueError):
    """A configuration key, value or type is wrong."""


class AllocationError(ConfigError):
    """An allocation-mode string is malformed or breaks a rule.

    `spec` is the string and `position` the 0-based offset of the problem in it (None when the
    rule concerns the whole string); `str(err)` shows the string with a caret under the position.
    """

    def __init__(self, message: str, spec: str = "", position: int | None = None):
        self.reason = message
        self.spec = spec
        self.position = position
        super().__init__(self._render())

    def _render(self) -> str:
        if not self.spec:
            return self.reason
        text = f"invalid allocation mode {self.spec!r}: {self.reason}"
        if self.position is not None:
            text += f"\n  {self.spec}\n  {' ' * self.position}^"
        return text


class CheckpointError(TandemError, OSError):
    """A model directory or weight file is missing, unreadable or inconsistent."""


class ModelConfigError(TandemError, ValueError):
    """A model `config.json` is unsupported or inconsistent."""


class SandboxUnavailable(TandemError, RuntimeError):
    """Untrusted code cannot be isolated here (no bubblewrap, no user namespaces, a failed
    self-test); the message says why and how to fix it. The sandbox never runs code unisolated."""
