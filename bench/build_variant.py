"""Build a plan with fields of one sm_90 launch-rule row replaced: an experiment's variant, never a
shipped default (the rows in kernels/targets.py are what builds use).

    python bench/build_variant.py matvec q4_warps=2 -- qwen3.5-0.8b --weights random --quant q4 \
        --target sm_90 -o bench/plans/variant.plan

Everything after ``--`` goes to ``kestrelc build``. Several rows at once: ``family.field=value`` for each
(``gdn_rows.num_warps=1 gdn_delta.num_warps=1 -- ...``). (The same as ``KESTREL_RULES="..." kestrelc build``,
kernels/targets.py's override_rules.)
"""
from __future__ import annotations

import sys

from kestrel.compiler.cli import main as kestrelc
from kestrel.kernels.targets import override_rules

if __name__ == "__main__":
    cut = sys.argv.index("--")
    args = sys.argv[1:cut]
    if "=" not in args[0]:  # FAMILY field=value ...
        args = [f"{args[0]}.{a}" for a in args[1:]]
    print("variant:", " ".join(override_rules("sm_90", " ".join(args))))
    sys.argv = ["kestrelc", "build"] + sys.argv[cut + 1:]
    kestrelc()
