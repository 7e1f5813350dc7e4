"""Errors of a run that has started (a worker died, a call failed or timed out): exit code 1."""

from __future__ import annotations


class RunFailed(Exception):
    """A run stopped after its workers started; the message names the role, set and rank."""
