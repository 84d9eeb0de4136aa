"""Typed errors of the inference engine; the HTTP server answers them with 400."""

from __future__ import annotations

from tandem.errors import TandemError


class RequestError(TandemError, ValueError):
    """A generation request is invalid (bad sampling field, prompt too long, duplicate rid)."""


class WeightUpdateError(TandemError, ValueError):
    """A weight update was rejected as a whole (unknown/missing tensor, wrong shape or dtype);
    the previous weights keep serving."""


class EngineBusyError(TandemError, RuntimeError):
    """An operation that needs an idle engine (flush_cache) was asked while requests run."""
