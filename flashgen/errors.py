"""Exceptions raised by flashgen, with positioned messages for spec errors."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FlashgenError(Exception):
    """Base class of every flashgen exception."""


class SpecError(FlashgenError, ValueError):
    """A spec that does not parse or does not validate.

    The message has the form ``file:line:col: error: what``, then the source line with a caret
    under the column, then what was expected and, for names, the nearest valid one.
    """

    def __init__(
        self,
        message: str,
        *,
        file: str,
        source: str,
        line: int,
        column: int,
        expected: str | None = None,
        hint: str | None = None,
    ):
        self.file, self.line, self.column = file, line, column
        self.summary, self.expected, self.hint = message, expected, hint
        lines = source.splitlines() or [""]
        text = lines[line - 1] if 0 < line <= len(lines) else ""
        col = column
        if len(text) > 160:  # a long line is shown as a window around the column
            start = max(0, column - 1 - 80)
            end = min(len(text), start + 160)
            text = ("…" if start else "") + text[start:end] + ("…" if end < len(text) else "")
            col = column - start + (1 if start else 0)
        # The caret's indent copies the line's tabs, so it lines up however a terminal shows them.
        indent = "".join("\t" if c == "\t" else " " for c in text[: col - 1])
        parts = [f"{file}:{line}:{column}: error: {message}", f"    {text}", f"    {indent}^"]
        if expected:
            parts.append(f"expected {expected}")
        if hint:
            parts.append(hint)
        super().__init__("\n".join(parts))


class BuildError(FlashgenError, RuntimeError):
    """The compiler failed on a generated source; the message holds its output and the path."""


class KernelError(FlashgenError, RuntimeError):
    """A kernel entry point reported a failure (for example a failed CUDA launch)."""


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """'did you mean 'x'?' for the closest of ``choices`` to ``word``, or None."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None


class NotBuiltError(BuildError):
    """JIT is disabled (FLASHGEN_JIT=0) and no ahead-of-time directory holds the kernel a call
    needs; the message names the variant, the directories searched and the build command."""


class UntrustedPathError(BuildError):
    """A library was not loaded because another user could have replaced it: its cache entry or
    ahead-of-time directory (or the library itself) is owned by someone other than the current
    user or root, or is writable by others. The message names the path and the fix."""
