"""Errors users see: one exception type per layer, each with an exit code.

The CLI prints `str(error)` (what, where, how to fix) and exits with `exit_code`;
a traceback appears only with `--debug`.
"""

from __future__ import annotations

from collections.abc import Iterable

EXIT_OK = 0
EXIT_POLICY_FAILURE = 1
EXIT_USAGE = 2


class KvPolicyError(Exception):
    """Base class: a message meant for the user and the exit code that goes with it."""

    exit_code: int = EXIT_USAGE


class InputError(KvPolicyError):
    """Bad command-line or request input: unknown model/GPU, malformed numbers, bad files."""


class PolicyError(KvPolicyError):
    """A policy file that cannot be loaded or evaluated (schema, extends, unknown facts)."""


class PolicyFailure(KvPolicyError):
    """The policy worked but says no: failed tests, violated constraints, lint findings."""

    exit_code = EXIT_POLICY_FAILURE


def did_you_mean(word: str, choices: Iterable[str], n: int = 3) -> str:
    """Return ' Did you mean `a`, `b`?' for the closest choices, or '' when none is close."""
    import difflib  # on error paths only: not paid by every start

    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(word.lower(), list(lowered), n=n, cutoff=0.5)
    if not close:
        # Substring matches catch short ids such as `llama` -> every llama entry.
        close = [c for c in lowered if word.lower() in c][:n]
    if not close:
        return ""
    return " Did you mean " + ", ".join(f"`{lowered[c]}`" for c in close) + "?"


class LimitError(InputError):
    """A deployment vLLM itself refuses (context above the model's limit, a TP size the heads do not divide,
    a GPU count out of range such as `0xh100`).

    `field` names the input at fault (`context`, `tp`, `gpu`) so the HTTP service can point at it.
    """

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field
