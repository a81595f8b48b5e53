"""GPU targets Kestrel compiles for. A target names an architecture, not a part: where launch rules
need the number of SMs, they use the flagship part of that architecture (listed here)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    cc: int  # compute capability as Triton's GPUTarget takes it (90 for sm_90)
    sms: int
    part: str


TARGETS = {t.name: t for t in (
    Target("sm_80", 80, 108, "A100"),
    Target("sm_86", 86, 84, "RTX A6000"),
    Target("sm_89", 89, 142, "L40S"),
    Target("sm_90", 90, 132, "H100 / H200 SXM"),
    Target("sm_100", 100, 148, "B200"),
    Target("sm_120", 120, 170, "RTX 5090"),
)}
GPU_TARGETS = tuple(TARGETS)
ALL_TARGETS = ("cpu",) + GPU_TARGETS


def pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p
