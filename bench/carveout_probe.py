"""kestrel-run with every kernel's preferred shared-memory carveout set (an experiment, not a runtime
option): CARVEOUT=P (0-100, percent of the unified L1 / shared memory given to shared memory; -1: no preference,
the driver's choice kernel by kernel, also for a plan whose kernels carry the moe rule's carveout since stop 50).
Question it answers (stop 19): do programmatic edges slow some plans because kernels of different
shared-memory needs cannot share an SM's carveout while the next one waits resident?

    CARVEOUT=100 KESTREL_PDL=1 python3 bench/carveout_probe.py PLAN --prompt-ids ... --bench OUT.json
"""
import os

from kestrel.runtime import cuda as kc
from kestrel.runtime.cli import main

_init = kc.Kernel.__init__


def _init_with_carveout(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    cu = kc.driver()
    kc.check(cu.cuFuncSetAttribute(self.function,
                                   cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                   int(os.environ["CARVEOUT"])), "cuFuncSetAttribute (carveout)")


if "CARVEOUT" in os.environ:
    kc.Kernel.__init__ = _init_with_carveout

if __name__ == "__main__":
    main()
