"""Launch rules as per-target tables (kernels/targets.py): every target has a row for every kernel
family, sm_90's rows name where their numbers come from, the others say they are untuned, and the
launch functions read the rows — their outputs are pinned here for sm_90 and one untuned target
(sm_120: other SM count and opt-in shared memory), as recorded before the rules moved into tables."""
import dataclasses
import itertools
from pathlib import Path

import pytest

from kestrel.kernels.attention import SMEM_OPTIN, attn_splits, attn_step_launch
from kestrel.kernels.embedding import embedding_rmsnorm_launch, embedding_rows_launch
from kestrel.kernels.gated_delta import gdn_delta_launch, gdn_norm_launch
from kestrel.kernels.gemm import gemm_launch
from kestrel.kernels.matvec import matvec_launch
from kestrel.kernels.rmsnorm import rmsnorm_launch
from kestrel.kernels.sample import sample_launch, step_end_launch
from kestrel.kernels.targets import (FAMILIES, RULE_OF_THUMB, SM90_RULES, TARGETS, TUNED_ON, UNTUNED, Rule,
                                     untuned_note)

ROOT = Path(__file__).resolve().parent.parent


def L(grid, num_warps, **constexprs):
    return {"grid": grid, "num_warps": num_warps, "constexprs": constexprs}


EXPECTED_SM_90 = [
    (matvec_launch, (1024, 1024, 0), L([1024, 1, 1], 4, N=1024, K=1024, GROUP=0, BLOCK_N=1, BLOCK_K=1024, PDL_LATE=False, PRELOAD=True, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (6144, 1024, 0), L([1536, 1, 1], 4, N=6144, K=1024, GROUP=0, BLOCK_N=4, BLOCK_K=1024, PDL_LATE=False, PRELOAD=True, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (1024, 3584, 0), L([1024, 1, 1], 4, N=1024, K=3584, GROUP=0, BLOCK_N=1, BLOCK_K=2048, PDL_LATE=False, PRELOAD=True, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (248320, 1024, 0), L([15520, 1, 1], 4, N=248320, K=1024, GROUP=0, BLOCK_N=16, BLOCK_K=512, PDL_LATE=True, PRELOAD=False, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (5120, 17408, 0), L([640, 1, 1], 2, N=5120, K=17408, GROUP=0, BLOCK_N=8, BLOCK_K=512, PDL_LATE=True, PRELOAD=False, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (17408, 5120, 0), L([1088, 1, 1], 4, N=17408, K=5120, GROUP=0, BLOCK_N=16, BLOCK_K=512, PDL_LATE=True, PRELOAD=False, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (5120, 17408, 128), L([640, 1, 1], 4, N=5120, K=17408, GROUP=128, BLOCK_N=8, BLOCK_K=2048, PDL_LATE=True, PRELOAD=False, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (34816, 5120, 32), L([2176, 1, 1], 1, N=34816, K=5120, GROUP=32, BLOCK_N=16, BLOCK_K=512, PDL_LATE=True, PRELOAD=False, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (6144, 1024, 64), L([768, 1, 1], 4, N=6144, K=1024, GROUP=64, BLOCK_N=8, BLOCK_K=1024, PDL_LATE=False, PRELOAD=False, L2_PREFETCH=True, PAIR_FMA=False, TOGETHER=True)),
    (matvec_launch, (392, 128, 0), L([392, 1, 1], 1, N=392, K=128, GROUP=0, BLOCK_N=1, BLOCK_K=128, PDL_LATE=False, PRELOAD=True, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (matvec_launch, (64, 32, 32), L([16, 1, 1], 1, N=64, K=32, GROUP=32, BLOCK_N=4, BLOCK_K=32, PDL_LATE=False, PRELOAD=False, L2_PREFETCH=True, PAIR_FMA=False, TOGETHER=True)),
    (matvec_launch, (8192, 7, 0), L([1024, 1, 1], 1, N=8192, K=7, GROUP=0, BLOCK_N=8, BLOCK_K=8, PDL_LATE=False, PRELOAD=True, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False)),
    (attn_splits, (2, 4096), 32),
    (attn_splits, (2, 131072), 64),
    (attn_splits, (4, 4096), 32),
    (attn_splits, (4, 131072), 32),
    (attn_splits, (1, 256), 2),
    (attn_splits, (1, 16), 1),
    (attn_step_launch, (8, 2, 256, 4096, 32, "bf16"),
     L([2, 32, 1], 4, NH=8, NKV=2, D=256, S=4096, SPLITS=32, BLOCK_H=16, BLOCK_Q=4, BLOCK_D=256, BLOCK_S=64, SPLIT_ROWS=128, PIPE_BYTES=131072,
       MERGE_CH=32, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False)),
    (attn_step_launch, (24, 4, 256, 4096, 32, "bf16"),
     L([4, 32, 1], 4, NH=24, NKV=4, D=256, S=4096, SPLITS=32, BLOCK_H=16, BLOCK_Q=8, BLOCK_D=256, BLOCK_S=64, SPLIT_ROWS=128, PIPE_BYTES=131072,
       MERGE_CH=32, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False)),
    (attn_step_launch, (24, 4, 256, 4096, 32, "f32"),
     L([4, 32, 1], 8, NH=24, NKV=4, D=256, S=4096, SPLITS=32, BLOCK_H=8, BLOCK_Q=8, BLOCK_D=256, BLOCK_S=32, SPLIT_ROWS=64, PIPE_BYTES=131072,
       MERGE_CH=32, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False)),
    (attn_step_launch, (4, 2, 64, 256, 2, "bf16"),
     L([2, 2, 1], 4, NH=4, NKV=2, D=64, S=256, SPLITS=2, BLOCK_H=16, BLOCK_Q=2, BLOCK_D=64, BLOCK_S=64, SPLIT_ROWS=128, PIPE_BYTES=131072,
       MERGE_CH=2, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False)),
    (attn_step_launch, (8, 2, 256, 8192, 64, "bf16"),  # more splits than the combine's chunk: its small path on
     L([2, 64, 1], 4, NH=8, NKV=2, D=256, S=8192, SPLITS=64, BLOCK_H=16, BLOCK_Q=4, BLOCK_D=256, BLOCK_S=64, SPLIT_ROWS=128,
       PIPE_BYTES=131072, MERGE_CH=32, MERGE_STAGES=2, MERGE_SMALL=8, MERGE_SMALL_STAGES=4, DOT_FP32=False)),
    (attn_step_launch, (2, 1, 16, 16, 1, "f32"),
     L([1, 1, 1], 8, NH=2, NKV=1, D=16, S=16, SPLITS=1, BLOCK_H=2, BLOCK_Q=2, BLOCK_D=16, BLOCK_S=64, SPLIT_ROWS=128, PIPE_BYTES=131072,
       MERGE_CH=1, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False)),
    (gdn_delta_launch, (16, 48, 128, 128, 4),
     L([48, 16, 1], 1, HK=16, HV=48, DK=128, DV=128, KC=4, BLOCK_DK=128, BLOCK_V=8, PRELOAD=True)),
    (gdn_delta_launch, (2, 4, 16, 16, 4), L([4, 2, 1], 1, HK=2, HV=4, DK=16, DV=16, KC=4, BLOCK_DK=16, BLOCK_V=8, PRELOAD=True)),
    (gdn_delta_launch, (4, 8, 64, 64, 4), L([8, 8, 1], 1, HK=4, HV=8, DK=64, DV=64, KC=4, BLOCK_DK=64, BLOCK_V=8, PRELOAD=True)),
    (gdn_norm_launch, (48, 128, 10240, 4),
     L([48, 1, 1], 4, HV=48, DV=128, C=10240, KC=4, BLOCK_DV=128, CH_PER_PROG=214, BLOCK_CH=256)),
    (gdn_norm_launch, (4, 16, 128, 4),
     L([4, 1, 1], 4, HV=4, DV=16, C=128, KC=4, BLOCK_DV=16, CH_PER_PROG=32, BLOCK_CH=32)),
    (rmsnorm_launch, ((5120,),), L([1, 1, 1], 8, N=5120, BLOCK=8192)),
    (rmsnorm_launch, ((1024,),), L([1, 1, 1], 4, N=1024, BLOCK=1024)),
    (rmsnorm_launch, ((2048,),), L([1, 1, 1], 8, N=2048, BLOCK=2048)),
    (rmsnorm_launch, ((24, 256),), L([24, 1, 1], 4, N=256, BLOCK=256)),
    (embedding_rmsnorm_launch, (5120,), L([1, 1, 1], 8, H=5120, BLOCK=8192)),
    (embedding_rmsnorm_launch, (1024,), L([1, 1, 1], 4, H=1024, BLOCK=1024)),
    (embedding_rows_launch, (16, 5120, 4096), L([16, 5, 1], 4, H=5120, S=4096, BLOCK=1024)),
    (embedding_rows_launch, (16, 1500, 4096), L([16, 2, 1], 4, H=1500, S=4096, BLOCK=1024)),
    (sample_launch, (248320,), L([61, 1, 1], 8, V=248320, TILE=4096, CAND=32, BLOCK=2048)),
    (sample_launch, (151936,), L([38, 1, 1], 8, V=151936, TILE=4096, CAND=32, BLOCK=2048)),
    (sample_launch, (16,), L([1, 1, 1], 8, V=16, TILE=16, CAND=16, BLOCK=512)),
    (step_end_launch, (4096,), L([1, 1, 1], 1, S=4096)),
]
# sm_120 (untuned: sm_90's rows, but 170 SMs and 99 KiB of opt-in shared memory): where it differs (attention
# at D = 256: half the rows per tile, so that two K/V tile pairs fit in the pipeline)
SM_120_DIFFERS = {
    (matvec_launch, (5120, 17408, 0)): L([1280, 1, 1], 1, N=5120, K=17408, GROUP=0, BLOCK_N=4, BLOCK_K=512, PDL_LATE=True, PRELOAD=False, L2_PREFETCH=False, PAIR_FMA=False, TOGETHER=False),
    (attn_step_launch, (8, 2, 256, 4096, 32, "bf16")):
        L([2, 32, 1], 4, NH=8, NKV=2, D=256, S=4096, SPLITS=32, BLOCK_H=16, BLOCK_Q=4, BLOCK_D=256, BLOCK_S=32, SPLIT_ROWS=64, PIPE_BYTES=68608,
          MERGE_CH=32, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False),
    (attn_step_launch, (24, 4, 256, 4096, 32, "bf16")):
        L([4, 32, 1], 4, NH=24, NKV=4, D=256, S=4096, SPLITS=32, BLOCK_H=16, BLOCK_Q=8, BLOCK_D=256, BLOCK_S=32, SPLIT_ROWS=64,
          PIPE_BYTES=68608, MERGE_CH=32, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False),
    (attn_step_launch, (24, 4, 256, 4096, 32, "f32")):
        L([4, 32, 1], 8, NH=24, NKV=4, D=256, S=4096, SPLITS=32, BLOCK_H=8, BLOCK_Q=8, BLOCK_D=256, BLOCK_S=16, SPLIT_ROWS=32, PIPE_BYTES=84992,
          MERGE_CH=32, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False),
    (attn_step_launch, (4, 2, 64, 256, 2, "bf16")):
        L([2, 2, 1], 4, NH=4, NKV=2, D=64, S=256, SPLITS=2, BLOCK_H=16, BLOCK_Q=2, BLOCK_D=64, BLOCK_S=64, SPLIT_ROWS=128, PIPE_BYTES=87040,
          MERGE_CH=2, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False),
    (attn_step_launch, (8, 2, 256, 8192, 64, "bf16")):
        L([2, 64, 1], 4, NH=8, NKV=2, D=256, S=8192, SPLITS=64, BLOCK_H=16, BLOCK_Q=4, BLOCK_D=256, BLOCK_S=32, SPLIT_ROWS=64,
          PIPE_BYTES=68608, MERGE_CH=32, MERGE_STAGES=2, MERGE_SMALL=8, MERGE_SMALL_STAGES=4, DOT_FP32=False),
    (attn_step_launch, (2, 1, 16, 16, 1, "f32")):
        L([1, 1, 1], 8, NH=2, NKV=1, D=16, S=16, SPLITS=1, BLOCK_H=2, BLOCK_Q=2, BLOCK_D=16, BLOCK_S=64, SPLIT_ROWS=128, PIPE_BYTES=93056,
          MERGE_CH=1, MERGE_STAGES=2, MERGE_SMALL=0, MERGE_SMALL_STAGES=4, DOT_FP32=False),
}
EXPECTED_SM_120 = [(fn, args, SM_120_DIFFERS.get((fn, args), want)) for fn, args, want in EXPECTED_SM_90]


@pytest.mark.parametrize("target,expected", [("sm_90", EXPECTED_SM_90), ("sm_120", EXPECTED_SM_120)])
def test_launch_outputs_unchanged(target, expected):
    t = TARGETS[target]
    for fn, args, want in expected:
        got = fn(*args, t)
        assert got == want, f"{fn.__name__}{args} on {target}: {got} != {want}"
        if isinstance(want, dict):  # same key order too: the plan's JSON keeps it
            assert list(got) == list(want) and list(got["constexprs"]) == list(want["constexprs"])


def test_every_target_has_every_family():
    assert set(FAMILIES) == {"matvec", "attention", "gdn_delta", "gdn_norm", "rmsnorm", "embedding", "sample",
                             "step_end", "gemm", "attn_rows", "gdn_rows", "speculative", "matvec_rows", "moe", "q4_mma",
                             "bf16_mma", "q4_stream"}
    for t in TARGETS.values():
        assert set(t.rules) == set(FAMILIES), t.name
        for fam, row in t.rules.items():
            assert isinstance(row, Rule) and type(row) is type(SM90_RULES[fam]), (t.name, fam)
            assert row.provenance, (t.name, fam)
        assert t.sms > 0 and t.smem_optin >= 48 * 1024


def test_sm90_rows_are_tuned_and_name_existing_files():
    t = TARGETS[TUNED_ON]
    assert t.tuned and untuned_note(t) is None
    files = set()
    for fam, row in t.rules.items():
        assert row.tuned, fam
        for p in row.provenance:
            if p == RULE_OF_THUMB:
                continue
            assert p.startswith("bench/results/") and (ROOT / p).is_file(), f"{fam}: {p} does not exist"
            files.add(p)
    for p in ("bench/results/tuning/q4-decode-sweep-h200.json", "bench/results/tuning/matvec-sweep-small-h200.json"):
        assert p in t.rules["matvec"].provenance
    assert "bench/results/stop18/device-call3-console.txt" in t.rules["sample"].provenance
    assert any("attn-" in p for p in t.rules["attention"].provenance)
    assert len(files) >= 9


@pytest.mark.parametrize("name", [n for n in TARGETS if n != TUNED_ON])
def test_other_targets_report_untuned(name):
    t = TARGETS[name]
    assert not t.tuned
    assert untuned_note(t) == f"launch rules for {name} are untuned (H200 sm_90 values)"
    for fam, row in t.rules.items():
        assert not row.tuned and row.provenance == (UNTUNED,), (name, fam)
        # the sm_90 values, only the marking differs
        assert dataclasses.replace(row, tuned=True, provenance=SM90_RULES[fam].provenance) == SM90_RULES[fam]


def test_smem_optin_is_a_target_fact():
    assert {t.cc: t.smem_optin for t in TARGETS.values()} == SMEM_OPTIN
    assert TARGETS["sm_90"].smem_optin == 227 * 1024 and TARGETS["sm_86"].smem_optin == 99 * 1024


# one call per family and the row field it must read: changing that field must change the output
READS = [
    (matvec_launch, (248320, 5120, 0), "matvec", "max_block_n", 8),
    (matvec_launch, (17408, 5120, 128), "matvec", "q4_wide_block_k", 1024),
    (matvec_launch, (5120, 17408, 128), "matvec", "q4_long_block_k", 1024),
    (matvec_launch, (1024, 3584, 0), "matvec", "small_max_block_k", 1024),
    (attn_splits, (4, 131072), "attention", "split_programs", 256),
    (attn_step_launch, (8, 2, 256, 4096, 32, "bf16"), "attention", "pipe_bytes_max", 64 * 1024),
    (attn_step_launch, (24, 4, 256, 4096, 32, "bf16"), "attention", "tile_bytes", 16 * 1024),
    (attn_step_launch, (24, 4, 256, 4096, 32, "f32"), "attention", "fma_num_warps", 4),
    (attn_step_launch, (24, 4, 256, 4096, 32, "bf16"), "attention", "min_tiles_in_flight", 3),
    (matvec_launch, (6144, 1024, 64), "matvec", "q4_one_tile_together", False),
    (gdn_delta_launch, (16, 48, 128, 128, 4), "gdn_delta", "max_block_v", 4),
    (gdn_norm_launch, (48, 128, 10240, 4), "gdn_norm", "num_warps", 8),
    (rmsnorm_launch, ((5120,),), "rmsnorm", "wide_warps", 16),
    (embedding_rows_launch, (16, 5120, 4096), "embedding", "block", 512),
    (embedding_rmsnorm_launch, (5120,), "rmsnorm", "wide_warps", 16),
    (sample_launch, (248320,), "sample", "tile", 2048),
    (step_end_launch, (4096,), "step_end", "num_warps", 2),
    (gemm_launch, (512, 5120, 17408, 0), "gemm", "bf16_many", (64, 64, 64, 4)),
    (gemm_launch, (128, 5120, 6144, 128), "gemm", "q4_few", (64, 64, 128, 4)),
    (gemm_launch, (4, 5120, 6144, 0), "gemm", "bf16_skinny", (16, 32, 128, 4)),
]


def test_gemm_rule_picks_the_sweeps_best():
    """On sm_90 the M-row GEMM's rule picks the fastest configuration the H200 sweep measured for every
    swept case (bench/results/tuning/gemm-sweep-h200.json)."""
    import json

    sweep = json.load(open(ROOT / "bench/results/tuning/gemm-sweep-h200.json"))
    shapes = {"27b in_proj_qkv+z+b+a": (16480, 5120), "27b out_proj": (5120, 6144), "27b mlp down": (5120, 17408),
              "0.8b in_proj": (6144, 1024)}
    assert len(sweep["best"]) == 16
    for best in sweep["best"]:
        n, k = shapes[best["shape"]]
        c = gemm_launch(best["M"], n, k, best["group"], TARGETS["sm_90"])["constexprs"]
        got = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], gemm_launch(best["M"], n, k, best["group"],
                                                                   TARGETS["sm_90"])["num_warps"])
        assert got == (best["BLOCK_M"], best["BLOCK_N"], best["BLOCK_K"], best["num_warps"]), best


def test_gemm_rule_at_a_few_rows_is_near_the_skinny_sweeps_best():
    """At 4 rows (a verify step) the bf16 rule's tiles are within 1.11x of the fastest of the 48
    configurations the H200 measured at every 27B projection, and q4's within 1.20x
    (bench/results/tuning/gemm-skinny-sweep-h200.json); gemm_swiglu's are the fastest of its sweep."""
    import json

    sweep = json.load(open(ROOT / "bench/results/tuning/gemm-skinny-sweep-h200.json"))["rows"]
    shapes = {"27b in_proj_qkv+z+b+a": (16480, 5120), "27b attn qkv": (14336, 5120), "27b out_proj": (5120, 6144),
              "27b mlp down": (5120, 17408), "27b mlp gate": (17408, 5120)}
    for (name, (n, k)), group in itertools.product(shapes.items(), (0, 128)):
        rows = [r for r in sweep if r["shape"] == name and r["group"] == group and r["max_rel_err"] < 1e-2]
        assert len(rows) > 20
        launch = gemm_launch(4, n, k, group, TARGETS["sm_90"])
        c = launch["constexprs"]
        pick = [r for r in rows if (r["BLOCK_M"], r["BLOCK_N"], r["BLOCK_K"], r["num_warps"]) ==
                (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], launch["num_warps"])]
        assert pick and pick[0]["us"] <= (1.11 if group == 0 else 1.20) * min(r["us"] for r in rows), (name, group)
    swiglu = json.load(open(ROOT / "bench/results/tuning/gemm-skinny-swiglu-sweep-h200.json"))["rows"]
    for group in (0, 128):  # gemm_swiglu at the 27B MLP: the rule picks the fastest
        rows = [r for r in swiglu if r["group"] == group and r["max_rel_err"] < 1e-2]
        launch = gemm_launch(4, 17408, 5120, group, TARGETS["sm_90"], swiglu=True)
        c = launch["constexprs"]
        best = min(rows, key=lambda r: r["us"])
        assert (best["BLOCK_M"], best["BLOCK_N"], best["BLOCK_K"], best["num_warps"]) == (
            c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], launch["num_warps"]), group


@pytest.mark.parametrize("fn,args,family,field,value", READS, ids=lambda x: x.__name__ if callable(x) else None)
def test_launch_functions_read_the_table(fn, args, family, field, value):
    t = TARGETS["sm_90"]
    rules = dict(t.rules)
    rules[family] = dataclasses.replace(rules[family], **{field: value})
    assert fn(*args, dataclasses.replace(t, rules=rules)) != fn(*args, t)


def test_overridden_rules_hold_for_the_block_only():
    """overridden_rules: the rows changed inside the block (and whatever else changed them there) come back after
    it, on an error too; exact_verify_rules names fields every GPU target has."""
    from kestrel.kernels.targets import exact_verify_rules, overridden_rules

    for name in [n for n in TARGETS if n != "cpu"]:
        before = TARGETS[name]
        with pytest.raises(RuntimeError):
            with overridden_rules(name, exact_verify_rules(4)) as done:
                assert len(done) == 9 and TARGETS[name].rules["gdn_delta"].fp_fusion is False
                assert TARGETS[name].rules["attn_rows"].step_order_rows == 4
                raise RuntimeError("inside")
        assert TARGETS[name] is before and before.rules["gdn_delta"].fp_fusion is True


def test_normed_q4_many_rows_split_is_its_own_rule():
    """rmsnorm_matvec at a q4 many-rows shape (the 27B in_proj) takes matvec.q4_wide_norm_block_n /
    q4_wide_norm_warps (by default 32 rows, two warps: the 27B q4 step 1.3% faster than at matvec_launch's 16 rows,
    one warp); the plain matvec, the normed product with fewer rows and the normed pair keep matvec_launch's
    split, and so does the normed product with the fields set to it."""
    from kestrel.kernels.matvec import rmsnorm_matvec_launch

    t = TARGETS["sm_90"]
    base = matvec_launch(16480, 5120, 128, t)
    assert (base["num_warps"], base["constexprs"]["BLOCK_N"]) == (1, 16)
    norm = rmsnorm_matvec_launch(16480, 5120, 128, 640, t)
    assert (norm["grid"], norm["num_warps"], norm["constexprs"]["BLOCK_N"]) == ([515, 1, 1], 2, 32)
    rules = dict(t.rules)
    rules["matvec"] = dataclasses.replace(rules["matvec"], q4_wide_norm_block_n=16, q4_wide_norm_warps=1)
    t2 = dataclasses.replace(t, rules=rules)
    norm = rmsnorm_matvec_launch(16480, 5120, 128, 640, t2)
    assert (norm["grid"], norm["num_warps"], norm["constexprs"]["BLOCK_N"]) == (base["grid"], 1, 16)
    assert norm["constexprs"]["BLOCK_K"] == base["constexprs"]["BLOCK_K"]
    assert matvec_launch(16480, 5120, 128, t2) == base
    few = rmsnorm_matvec_launch(8224, 1024, 128, 256, t2)
    assert few["constexprs"]["BLOCK_N"] == matvec_launch(8224, 1024, 128, t2)["constexprs"]["BLOCK_N"]
    pair = rmsnorm_matvec_launch(17408, 5120, 128, 640, t2, pair=True)
    assert pair["constexprs"]["BLOCK_N"] == 16 and pair["num_warps"] == 2


def test_normed_q4_products_at_hidden_2048():
    """matvec.q4_norm_short_k (2048 on sm_90): a normed q4 product with K at most that takes q4_norm_short_wide's
    split with many rows (Qwen3-Next-80B's in_proj, 12352 x 2048: 16 rows, 2 warps) and the whole of K in one tile
    (NORM_TILE: its rstd from that tile, no partials read) with fewer (its attention's q|gate|k|v, 9216 x 2048; the
    2B's projections); K = 5120 (27B) keeps q4_wide_norm_*, K = 1024 (0.8B) its one tile, bf16 matvec_launch's
    split (the q4 pair: matvec.q4_pair_norm's, below); with the field at 0 every shape is as before (stop 38 call 6:
    80B-A3B q4 1.875 -> 1.840 ms/token, 2B q4 0.787 -> 0.770)."""
    from kestrel.kernels.matvec import NORM_PARTIALS, NORM_TILE, rmsnorm_matvec_launch

    t = TARGETS["sm_90"]
    wide = rmsnorm_matvec_launch(12352, 2048, 128, 128, t)
    assert (wide["grid"], wide["num_warps"], wide["constexprs"]["BLOCK_N"]) == ([772, 1, 1], 2, 16)
    few = rmsnorm_matvec_launch(9216, 2048, 128, 128, t)
    assert few["constexprs"]["BLOCK_K"] == 2048 and few["constexprs"]["NORM"] == NORM_TILE.value
    assert few["grid"] == matvec_launch(9216, 2048, 128, t)["grid"]
    assert rmsnorm_matvec_launch(16480, 5120, 128, 640, t)["constexprs"]["BLOCK_N"] == 32
    assert rmsnorm_matvec_launch(6144, 1024, 128, 256, t)["constexprs"]["BLOCK_K"] == 1024
    assert rmsnorm_matvec_launch(9216, 2048, 0, 128, t)["constexprs"]["BLOCK_K"] == \
        matvec_launch(9216, 2048, 0, t)["constexprs"]["BLOCK_K"]
    off = dataclasses.replace(t, rules={**t.rules, "matvec": dataclasses.replace(t.rules["matvec"], q4_norm_short_k=0)})
    old = rmsnorm_matvec_launch(9216, 2048, 128, 128, off)
    assert old["constexprs"]["BLOCK_K"] == 1024 and old["constexprs"]["NORM"] == NORM_PARTIALS.value
    assert rmsnorm_matvec_launch(12352, 2048, 128, 128, off)["constexprs"]["BLOCK_N"] == 32


def test_normed_q4_pair_split_by_k():
    """matvec.q4_pair_norm: the normed q4 gate / up pair (rmsnorm_matvec_swiglu) takes the split of the first row
    whose K bound holds (stop 40 call 7's sweep, calls 8-9's steps): the 2B MLP (6144 x 2048) 8 rows x its whole K
    x 8 warps (NORM_TILE), the 4B (9216 x 2560) 16 x 512 x 2, the 0.8B (3584 x 1024) 8 x 1024 x 4 as the rule
    gave before; past the last row (the 9B's K = 4096) and with the field empty the rule's own split, and a small K
    one tile of its power of two on a warp; bf16 pairs never."""
    from kestrel.kernels.matvec import NORM_TILE, rmsnorm_matvec_launch

    t = TARGETS["sm_90"]

    def split(n, k, target=t, group=128):
        r = rmsnorm_matvec_launch(n, k, group, 256, target, pair=True)
        return r["grid"][0], r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_K"], r["num_warps"]

    off = dataclasses.replace(t, rules={**t.rules, "matvec": dataclasses.replace(t.rules["matvec"], q4_pair_norm=())})
    assert split(6144, 2048) == (768, 8, 2048, 8) != split(6144, 2048, off)
    assert rmsnorm_matvec_launch(6144, 2048, 128, 256, t, pair=True)["constexprs"]["NORM"] == NORM_TILE.value
    assert split(9216, 2560) == (576, 16, 512, 2) != split(9216, 2560, off)
    assert split(3584, 1024) == split(3584, 1024, off) == (448, 8, 1024, 4)
    assert split(12288, 4096) == split(12288, 4096, off)
    assert split(96, 64, group=32) == (12, 8, 64, 1)
    assert split(6144, 2048, group=0) == split(6144, 2048, off, group=0)


def test_q4_matvecs_before_attention_and_the_gdn_step_trigger_early(tmp_path, monkeypatch):
    """matvec.pdl_early_before (compiler/codegen.py): a q4 matvec late by its bytes (here every one:
    pdl_late_bytes = 0) that comes right before an ``attn_step`` or ``gdn_delta`` launch of the one-token step is
    compiled to trigger at its start, its late variant the launch rule's own form; the other late ones stay late;
    with the field empty the same launches are late."""
    from kestrel.artifacts.plan import load_plan
    from kestrel.compiler.build import build
    from kestrel.kernels.targets import override_rules

    def lates(early_before):
        monkeypatch.setitem(TARGETS, "sm_90", TARGETS["sm_90"])  # restored after the test
        override_rules("sm_90", f"matvec.pdl_late_bytes=0 matvec.pdl_early_before={early_before!r}")
        path = tmp_path / f"p{len(early_before)}.plan"
        build("tiny", str(path), target="sm_90", quant="q4", log=lambda m: None, progress=False)
        lp = load_plan(str(path)).launch_plan
        ks, ops = lp["kernels"], [x["op"] for x in lp["launches"]]
        before = {i for i in range(len(ops) - 1) if ops[i + 1] in ("attn_step", "gdn_delta")}
        return {i: ks[x["kernel_index"]] for i, x in enumerate(lp["launches"])
                if "PDL_LATE" in ks[x["kernel_index"]]["constexprs"]}, before, ks

    late, before, ks = lates(("attn_step", "gdn_delta"))
    assert before and before <= set(late)
    for i, k in late.items():
        assert k["constexprs"]["PDL_LATE"] is (i not in before)
        if i in before:  # its late variant: the rule's own form
            assert ks[k["late"]]["constexprs"]["PDL_LATE"] is True
    plain, _, _ = lates(())
    assert all(k["constexprs"]["PDL_LATE"] is True for k in plain.values())


def test_pdl_early_before_takes_floating_point_matvecs_only_when_asked(tmp_path, monkeypatch):
    """matvec.pdl_early_q4_only (true by default: measured for bf16 in stop 39, 0.2-1% faster at 4B-27B, 2.4% slower
    at 2B): a bf16 plan's late matvecs before attention and the GDN step stay late unless the field is false."""
    from kestrel.artifacts.plan import load_plan
    from kestrel.compiler.build import build
    from kestrel.kernels.targets import override_rules

    def early_count(q4_only):
        monkeypatch.setitem(TARGETS, "sm_90", TARGETS["sm_90"])  # restored after the test
        override_rules("sm_90", "matvec.pdl_late_bytes=0 matvec.pdl_early_before=('attn_step','gdn_delta') "
                                f"matvec.pdl_early_q4_only={q4_only}")
        path = tmp_path / f"b{q4_only}.plan"
        build("tiny", str(path), target="sm_90", quant="bf16", log=lambda m: None, progress=False)
        lp = load_plan(str(path)).launch_plan
        ks, ops = lp["kernels"], [x["op"] for x in lp["launches"]]
        return sum(1 for i, x in enumerate(lp["launches"][:-1]) if ops[i + 1] in ("attn_step", "gdn_delta")
                   and ks[x["kernel_index"]]["constexprs"].get("PDL_LATE") is False)

    assert early_count(True) == 0 and early_count(False) > 0


@pytest.mark.parametrize("model,after", [("tiny", ("gdn_norm", "attn_step")), ("tiny-next", ("moe_down_add",))])
def test_q4_matvecs_right_after_the_listed_ops_load_their_first_tile_before_the_wait(model, after, tmp_path,
                                                                                     monkeypatch):
    """matvec.q4_preload_after (compiler/codegen.py): the one-token step's q4 matvecs right after an op of those
    kinds are compiled with PRELOAD (their late variants too), every other q4 matvec without; the field empty
    (the default before stop 42), or q4_preload_min_bytes above their weights' bytes: none."""
    from kestrel.artifacts.plan import load_plan
    from kestrel.compiler.build import build
    from kestrel.kernels.targets import override_rules

    def preloads(kinds, min_bytes=0):
        monkeypatch.setitem(TARGETS, "sm_90", TARGETS["sm_90"])  # restored after the test
        override_rules("sm_90", f"matvec.q4_preload_after={kinds!r} matvec.q4_preload_min_bytes={min_bytes}")
        path = tmp_path / f"{model}-{len(kinds)}.plan"
        build(model, str(path), target="sm_90", quant="q4", log=lambda m: None, progress=False)
        lp = load_plan(str(path)).launch_plan
        ks, ops = lp["kernels"], [x["op"] for x in lp["launches"]]
        q4 = {i: ks[x["kernel_index"]] for i, x in enumerate(lp["launches"])
              if ks[x["kernel_index"]]["constexprs"].get("GROUP") and "PRELOAD" in ks[x["kernel_index"]]["constexprs"]}
        return {i for i, k in q4.items() if k["constexprs"]["PRELOAD"]}, q4, ops, ks

    on, q4, ops, ks = preloads(after)
    assert on and on == {i for i in q4 if i > 0 and ops[i - 1] in after}
    assert all(ks[q4[i]["late"]]["constexprs"]["PRELOAD"] for i in on if "late" in q4[i])
    assert preloads(())[0] == set()
    assert preloads(after, 1 << 30)[0] == set()
