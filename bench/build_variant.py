"""Build a plan with fields of one sm_90 launch-rule row replaced: an experiment's variant, never a
shipped default (the rows in kernels/targets.py are what builds use).

    python bench/build_variant.py matvec q4_warps=2 -- qwen3.5-0.8b --weights random --quant q4 \
        --target sm_90 -o bench/plans/variant.plan

Everything after ``--`` goes to ``kestrelc build``.
"""
from __future__ import annotations

import ast
import dataclasses
import sys
from types import MappingProxyType

from kestrel.compiler.cli import main as kestrelc
from kestrel.kernels.targets import TARGETS


def patch(family: str, fields: dict) -> None:
    t = TARGETS["sm_90"]
    row = dataclasses.replace(t.rules[family], **fields)
    TARGETS["sm_90"] = dataclasses.replace(t, rules=MappingProxyType({**t.rules, family: row}))


if __name__ == "__main__":
    cut = sys.argv.index("--")
    family, *assignments = sys.argv[1:cut]
    patch(family, {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in assignments)})
    sys.argv = ["kestrelc", "build"] + sys.argv[cut + 1:]
    kestrelc()
