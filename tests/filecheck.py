"""A small FileCheck (LLVM's lit tool) for golden expectations a person can read.

Directives, one per line (``#`` lines and blank lines are comments):
  CHECK: PATTERN       the next line at or after the current position that matches; it becomes the position
  CHECK-NEXT: PATTERN  the line right after the previous match matches
  CHECK-SAME: PATTERN  the previous match's line also matches (after what it matched)
  CHECK-NOT: PATTERN   no line between the previous match and the next CHECK's match (or the end) matches
A PATTERN matches a line when it occurs in it as text; ``{{regex}}`` inside it is a regular expression.
"""
from __future__ import annotations

import re

DIRECTIVES = ("CHECK-NEXT", "CHECK-SAME", "CHECK-NOT", "CHECK")


class CheckFailure(AssertionError):
    pass


def _regex(pattern: str) -> re.Pattern:
    parts = re.split(r"\{\{(.*?)\}\}", pattern.strip())
    return re.compile("".join(p if i % 2 else re.escape(p) for i, p in enumerate(parts)))


def parse_checks(text: str) -> list[tuple[str, str, re.Pattern, int]]:
    checks = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        kind = next((d for d in DIRECTIVES if s.startswith(d + ":")), None)
        if kind is None:
            raise ValueError(f"line {n}: not a directive ({', '.join(DIRECTIVES)}): {line!r}")
        pattern = s[len(kind) + 1:]
        if not pattern.strip():
            raise ValueError(f"line {n}: {kind} with an empty pattern")
        checks.append((kind, pattern.strip(), _regex(pattern), n))
    if not any(k != "CHECK-NOT" for k, *_ in checks):
        raise ValueError("no positive CHECK directive: the expectation could not fail on a missing line")
    return checks


def filecheck(output: str, checks_text: str) -> None:
    """Raise CheckFailure naming the first directive the output does not satisfy."""
    lines = output.splitlines()
    pos, col = -1, 0  # the line of the previous match, and where its match ended
    pending_not: list = []

    def fail(kind, pattern, n, why):
        shown = lines[pos] if 0 <= pos < len(lines) else "<start of output>"
        raise CheckFailure(f"check line {n}: {kind}: {pattern!r} {why} (previous match: {shown!r})")

    def settle_nots(upto: int):
        for kind, pattern, rx, n in pending_not:
            for i in range(pos + 1, upto):
                if rx.search(lines[i]):
                    raise CheckFailure(f"check line {n}: CHECK-NOT: {pattern!r} found in output line {i + 1}: "
                                       f"{lines[i]!r}")
        pending_not.clear()

    for kind, pattern, rx, n in parse_checks(checks_text):
        if kind == "CHECK-NOT":
            pending_not.append((kind, pattern, rx, n))
        elif kind == "CHECK":
            i = next((i for i in range(pos + 1, len(lines)) if rx.search(lines[i])), None)
            if i is None:
                fail(kind, pattern, n, "matches no later line")
            settle_nots(i)
            pos, col = i, rx.search(lines[i]).end()
        elif kind == "CHECK-NEXT":
            i = pos + 1
            if i >= len(lines) or not rx.search(lines[i]):
                fail(kind, pattern, n, f"does not match the next line {lines[i] if i < len(lines) else '<end>'!r}")
            settle_nots(i)
            pos, col = i, rx.search(lines[i]).end()
        else:  # CHECK-SAME
            m = rx.search(lines[pos], col) if 0 <= pos < len(lines) else None
            if m is None:
                fail(kind, pattern, n, "does not match the rest of the previous match's line")
            col = m.end()
    settle_nots(len(lines))
