"""Embedding, RMSNorm, add+RMSNorm, sampling and step-end kernels: Triton's interpreter against the
torch references (fresh random inputs, bf16 paths included), and AOT compilation for every target."""
import pytest
import torch
import triton
import triton.language as tl

from kernel_harness import assert_close, interpret
from kestrel.compiler.codegen import compile_kernel
from kestrel.kernels.embedding import (embedding_kernel, embedding_launch, embedding_ref, embedding_rows_kernel,
                                       embedding_rows_launch, embedding_rows_ref)
from kestrel.kernels.rmsnorm import (add_rmsnorm_kernel, add_rmsnorm_ref, rmsnorm_kernel, rmsnorm_launch,
                                     rmsnorm_ref)
from kestrel.kernels.sample import (_uniform, chunk_last_kernel, chunk_last_ref, last_row_kernel, last_row_ref,
                                    prefill_end_kernel, prefill_end_ref, rows_tail_launch, sample_kernel, sample_launch,
                                    sample_ref, step_end_kernel, step_end_launch, step_end_ref, uniform_from)
from kestrel.kernels.targets import TARGETS

CCS = [t.cc for t in TARGETS.values()]


def i32(v):
    return torch.tensor([v], dtype=torch.int32)


def f32(v):
    return torch.tensor([v], dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding(dtype):
    g = torch.Generator().manual_seed(1)
    table = torch.randn(50, 1500, generator=g).to(dtype)
    out = torch.full((1500,), float("nan"))
    c = embedding_launch(1500, TARGETS["sm_90"])
    interpret(embedding_kernel)[tuple(c["grid"])](table, i32(37), out, **c["constexprs"])
    assert torch.equal(out, embedding_ref(table, 37))


# M-row chunks: (pos, n_prompt) with every row valid, a partial last chunk, none valid, past max_seq
ROW_CASES = [(0, 20), (8, 11), (16, 11), (4, 5), (10, 10)]


@pytest.mark.parametrize("pos,n_prompt", ROW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_rows(pos, n_prompt, dtype):
    g = torch.Generator().manual_seed(pos)
    table = torch.randn(50, 300, generator=g).to(dtype)
    tokens = torch.randint(0, 50, (12,), generator=g, dtype=torch.int32)
    out = torch.full((8, 300), float("nan"))
    c = embedding_rows_launch(8, 300, 12, TARGETS["sm_90"])
    consts = dict(c["constexprs"], BLOCK=128)
    grid = (8, 3)
    interpret(embedding_rows_kernel)[grid](table, tokens, i32(pos), i32(n_prompt), out, 8, **consts)
    assert torch.equal(out, embedding_rows_ref(table, tokens, pos, n_prompt, 8))


@pytest.mark.parametrize("pos,n_prompt", ROW_CASES)
def test_rows_tail_kernels(pos, n_prompt):
    g = torch.Generator().manual_seed(pos + 1)
    x = torch.randn(8, 300, generator=g)
    out = torch.full((300,), float("nan"))
    interpret(last_row_kernel)[(3,)](x, i32(pos), i32(n_prompt), out, ROWS=8, N=300, BLOCK=128)
    assert torch.equal(out, last_row_ref(x, pos, n_prompt))
    last = i32(-5)
    interpret(chunk_last_kernel)[(1,)](i32(pos), i32(n_prompt), last, 8, ROWS=8, BLOCK=128)
    assert int(last[0]) == chunk_last_ref(pos, n_prompt, 8)
    tokens = torch.randint(0, 50, (12,), generator=g, dtype=torch.int32)
    ref_tokens = tokens.clone()
    pos_slot, tok_slot = i32(pos), i32(-1)
    interpret(prefill_end_kernel)[(1,)](pos_slot, i32(77), i32(n_prompt), tokens, pos_slot, tok_slot, 8, ROWS=8, S=12,
                                        BLOCK=128)
    assert (int(pos_slot[0]), int(tok_slot[0])) == prefill_end_ref(pos, 77, n_prompt, ref_tokens, 8)
    assert torch.equal(tokens, ref_tokens)
    assert rows_tail_launch(5120, TARGETS["sm_90"])["grid"][0] * 1024 >= 5120


@pytest.mark.parametrize("shape", [(1, 1024), (4, 48), (1, 5120), (3, 100)])
def test_rmsnorm_and_add_rmsnorm(shape):
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    w = 0.1 * torch.randn(shape[-1], generator=g)
    c = rmsnorm_launch(shape, TARGETS["sm_90"])
    out = torch.full(shape, float("nan"))
    interpret(rmsnorm_kernel)[tuple(c["grid"])](x, w, out, 1e-6, **c["constexprs"])
    assert_close(out, rmsnorm_ref(x, w, 1e-6), 1e-5, 1e-6, "rmsnorm")
    s, n = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
    interpret(add_rmsnorm_kernel)[tuple(c["grid"])](x, y, w, s, n, 1e-6, **c["constexprs"])
    rs, rn = add_rmsnorm_ref(x, y, w, 1e-6)
    assert torch.equal(s, rs)
    assert_close(n, rn, 1e-5, 1e-6, "add_rmsnorm")


def run_sample(logits, temperature, top_p, seed, pos):
    c = sample_launch(logits.numel(), TARGETS["sm_90"])
    consts = dict(c["constexprs"], BLOCK=256)  # small block: several passes over a small vocabulary
    out = i32(-1)
    interpret(sample_kernel)[(1,)](logits, f32(temperature), f32(top_p), i32(seed), i32(pos), out, **consts)
    return int(out[0])


def test_sample_greedy_matches_argmax_first_index():
    g = torch.Generator().manual_seed(3)
    for v in (1000, 777):
        logits = torch.randn(v, generator=g)
        assert run_sample(logits, 0.0, 1.0, 0, 0) == sample_ref(logits, 0.0, 1.0, 0, 0)
    tied = torch.zeros(600)
    tied[[5, 300, 599]] = 3.0
    assert run_sample(tied, 0.0, 1.0, 0, 0) == 5


def test_sample_seeded_matches_reference():
    g = torch.Generator().manual_seed(4)
    logits = 3 * torch.randn(700, generator=g)
    agree = sum(run_sample(logits, t, p, seed, pos) == sample_ref(logits, t, p, seed, pos)
                for t, p, seed, pos in [(1.0, 1.0, 1, 5), (0.7, 0.9, 2, 11), (1.3, 0.5, 3, 0), (1.0, 0.95, 7, 99),
                                        (0.5, 1.0, 9, 3), (2.0, 0.8, 4, 42)])
    assert agree == 6  # float sums differ in order from torch; a boundary case may flip, none does here


@triton.jit
def _uniform_probe(seed_ptr, pos_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, _uniform(tl.load(seed_ptr + i), tl.load(pos_ptr + i)))


def test_device_uniform_matches_reference_hash():
    """sample_kernel's random number (the jit helper ``_uniform``) is bit for bit the reference's
    ``uniform_from`` over 1600 (seed, pos) pairs, and those are spread over [0, 1)."""
    pairs = [(s * 7919 % 2 ** 31, p * 104729 % 2 ** 31) for s in range(40) for p in range(40)]
    seeds = torch.tensor([s for s, _ in pairs] + [0] * 448, dtype=torch.int32)
    poss = torch.tensor([p for _, p in pairs] + [0] * 448, dtype=torch.int32)
    out = torch.zeros(2048, dtype=torch.float32)
    interpret(_uniform_probe)[(1,)](seeds, poss, out, BLOCK=2048)
    us = [uniform_from(s, p) for s, p in pairs]
    assert out[:1600].tolist() == us
    assert 0.45 < sum(us) / len(us) < 0.55 and len(set(us)) > 1500


@pytest.mark.parametrize("pos,n_prompt", [(0, 3), (1, 3), (2, 3), (5, 3), (7, 0), (8, 0), (-1, 1)])
def test_step_end(pos, n_prompt):
    """Inside the prompt: the next prompt id, sequence untouched; past it: the sampled token, appended;
    at the last row (and beyond): the write index is clamped."""
    seq = torch.arange(100, 108, dtype=torch.int32)
    p, sampled, n, token = i32(pos), i32(1234), i32(n_prompt), i32(-1)
    interpret(step_end_kernel)[(1,)](p, sampled, n, seq, p, token, S=8)
    ref_seq = torch.arange(100, 108, dtype=torch.int32)
    ref_pos, ref_token = step_end_ref(pos, 1234, n_prompt, ref_seq)
    assert (int(p[0]), int(token[0])) == (ref_pos, ref_token) and torch.equal(seq, ref_seq)
    assert ref_pos == pos + 1 and ref_token == (100 + pos + 1 if pos + 1 < n_prompt else 1234)


@pytest.mark.parametrize("cc", CCS)
def test_aot_compiles_for_every_target(cc):
    t = TARGETS["sm_90"]
    jobs = [
        ("embedding_bf16", embedding_kernel, ["*bf16", "*i32", "*fp32"], embedding_launch(5120, t)),
        ("rmsnorm", rmsnorm_kernel, ["*fp32", "*fp32", "*fp32", "fp32"], rmsnorm_launch((5120,), t)),
        ("add_rmsnorm", add_rmsnorm_kernel, ["*fp32"] * 5 + ["fp32"], rmsnorm_launch((5120,), t)),
        ("sample", sample_kernel, ["*fp32", "*fp32", "*fp32", "*i32", "*i32", "*i32"], sample_launch(248320, t)),
        ("step_end", step_end_kernel, ["*i32"] * 6, step_end_launch(4096, t)),
        ("embedding_rows_bf16", embedding_rows_kernel, ["*bf16", "*i32", "*i32", "*i32", "*fp32", "i32"],
         embedding_rows_launch(128, 5120, 4096, t)),
        ("last_row", last_row_kernel, ["*fp32", "*i32", "*i32", "*fp32"],
         {**rows_tail_launch(5120, t), "constexprs": {"BLOCK": 1024, "ROWS": 128, "N": 5120}}),
        ("chunk_last", chunk_last_kernel, ["*i32"] * 3 + ["i32"],
         {**rows_tail_launch(1, t), "constexprs": {"BLOCK": 1024, "ROWS": 128}}),
        ("prefill_end", prefill_end_kernel, ["*i32"] * 6 + ["i32"],
         {**rows_tail_launch(1, t), "constexprs": {"BLOCK": 1024, "ROWS": 128, "S": 4096}}),
    ]
    for kid, jit, types, launch in jobs:
        k = compile_kernel(kid, jit, types, launch["constexprs"], launch["num_warps"], cc)
        assert k.cubin[:4] == b"\x7fELF" and k.name and k.num_warps == launch["num_warps"]
        assert k.arch == f"sm_{cc}{'a' if cc >= 90 else ''}"


def test_fill_random_matches_numpy_twin():
    from kestrel.kernels.fill import FILL_BLOCK, fill_random_kernel, fill_random_ref

    out = torch.zeros(3000, dtype=torch.int32)
    interpret(fill_random_kernel)[(3,)](out, 12345, 2500, BLOCK=FILL_BLOCK)
    ref = fill_random_ref(2500, 12345)
    assert (out[:2500].numpy().view("u4") == ref).all() and (out[2500:] == 0).all()
    as_bf16 = torch.from_numpy(ref.copy()).view(torch.int32).view(torch.bfloat16).float()
    assert torch.isfinite(as_bf16).all() and as_bf16.abs().max() < 0.02 and as_bf16.abs().min() >= 2 ** -7
    k = compile_kernel("fill_random", fill_random_kernel, ["*i32", "i32", "i32"], {"BLOCK": FILL_BLOCK}, 4, 90)
    assert k.cubin[:4] == b"\x7fELF"
