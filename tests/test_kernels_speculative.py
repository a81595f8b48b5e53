"""The speculative iteration's kernels (--speculative mtp) in Triton's interpreter against their torch
references: the MTP head's join (concat), its input tokens (embedding_next_rows), the device-side
decisions (spec_begin, argmax_rows, accept, draft_end, spec_end), the verify's Gated DeltaNet with its
rows' updates and conv snapshots (gdn_rows_delta_snap, gdn_rows_norm_snap) and the commit (gdn_commit); and every
one AOT-compiled for every GPU target (clean subprocesses: kernel_harness.SplitCompile)."""
import dataclasses

import pytest
import torch

from kernel_harness import assert_close, interpret, split_compile_fixture
from kestrel.compiler.ops import OPS
from kestrel.kernels.embedding import embedding_next_rows_kernel, embedding_next_rows_ref, embedding_rows_launch
from kestrel.kernels.gated_delta import (gdn_commit_kernel, gdn_commit_launch, gdn_commit_ref, gdn_rows_delta_launch,
                                         gdn_rows_delta_snap_kernel, gdn_rows_delta_snap_ref, gdn_rows_norm_launch,
                                         gdn_rows_norm_snap_kernel, gdn_rows_norm_snap_ref, gdn_rows_ref,
                                         gdn_rows_snap_ref, update_row_width)
from kestrel.kernels.mtp import concat_kernel, concat_launch, concat_ref
from kestrel.kernels.speculative import (accept_kernel, accept_ref, argmax_rows_kernel, argmax_rows_launch,
                                         argmax_rows_ref, draft_end_kernel, draft_end_ref, spec_begin_kernel,
                                         spec_begin_ref, spec_end_kernel, spec_end_ref, spec_filter_launch,
                                         spec_rows_launch)
from kestrel.kernels.targets import ALL_TARGETS, TARGETS

SM90 = TARGETS["sm_90"]


def i32(v):
    return torch.tensor([v], dtype=torch.int32)


@pytest.mark.parametrize("rows", [1, 3])
def test_concat(rows):
    g = torch.Generator().manual_seed(rows)
    x, y = torch.randn(rows, 100, generator=g), torch.randn(rows, 60, generator=g)
    out = torch.full((rows, 160), float("nan"))
    c = concat_launch(rows, 100, 60, SM90)
    consts = dict(c["constexprs"], BLOCK=64)  # several programs per row, one straddling the join
    interpret(concat_kernel)[(rows, 3)](x, y, out, **consts)
    ref = concat_ref(x, y)
    assert torch.equal(out, ref) and torch.equal(ref[:, :100], x) and torch.equal(ref[:, 100:], y)
    assert c["grid"][0] == rows and c["grid"][1] * c["constexprs"]["BLOCK"] >= 160


# (pos, bound): the verify's K + 1 rows (every row valid, the last from `sampled`), a prefill chunk that
# ends the prompt inside it, one that does not end it, and no valid row
NEXT_CASES = [(5, 9, 4), (0, 3, 6), (2, 20, 6), (7, 7, 4)]


@pytest.mark.parametrize("pos,bound,rows", NEXT_CASES)
def test_embedding_next_rows(pos, bound, rows):
    g = torch.Generator().manual_seed(pos)
    table = torch.randn(50, 200, generator=g)
    tokens = torch.randint(0, 50, (16,), generator=g, dtype=torch.int32)
    out = torch.full((rows, 200), float("nan"))
    c = embedding_rows_launch(rows, 200, 16, SM90)
    consts = dict(c["constexprs"], BLOCK=128)
    interpret(embedding_next_rows_kernel)[(rows, 2)](table, tokens, i32(pos), i32(bound), i32(44), out, rows, **consts)
    ref = embedding_next_rows_ref(table, tokens, pos, bound, 44, rows)
    assert torch.equal(out, ref)
    valid = max(0, min(rows, bound - pos))
    for r in range(valid):  # the token after the row; the bound's last row takes `sampled`
        want = int(tokens[pos + r + 1]) if pos + r + 1 < bound else 44
        assert torch.equal(ref[r], table[want])
    assert torch.equal(ref[valid:], torch.zeros_like(ref[valid:]))


@pytest.mark.parametrize("vocab,block", [(1000, 256), (77, 32), (4096, 4096)])
def test_argmax_rows_first_index_among_ties(vocab, block):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g)
    logits[1, [3, vocab - 2]] = 9.0  # a tie across slices: the first index
    logits[2, [vocab // 2, vocab // 2 + 1]] = 9.0  # inside one slice
    logits[3, :] = 0.5  # all equal: index 0
    out = torch.full((4,), -1, dtype=torch.int32)
    interpret(argmax_rows_kernel)[(4,)](logits, out, V=vocab, BLOCK=block)
    ref = argmax_rows_ref(logits)
    assert torch.equal(out, ref)
    assert ref[1] == 3 and ref[2] == vocab // 2 and ref[3] == 0
    c = argmax_rows_launch(4, 248320, SM90)
    assert c["grid"] == [4, 1, 1] and c["constexprs"]["BLOCK"] <= 248320


@pytest.mark.parametrize("k,match", [(3, 3), (3, 0), (3, 1), (1, 1), (1, 0), (4, 2)])
def test_accept(k, match):
    """Drafts at tokens[pos+1..pos+k]; the target agrees on the first `match` of them."""
    pos, s = 5, 16
    tokens = torch.arange(100, 100 + s, dtype=torch.int32)
    targets = torch.tensor([int(tokens[pos + 1 + i]) if i < match else 900 + i for i in range(k + 1)],
                           dtype=torch.int32)
    ref_tokens = tokens.clone()
    npos, dpos, sampled, accepted = (i32(-9) for _ in range(4))
    interpret(accept_kernel)[(1,)](targets, i32(pos), tokens, npos, dpos, sampled, accepted, R=k + 1, S=s,
                                   BLOCK_R=8)
    ref = accept_ref(targets, pos, ref_tokens)
    assert (int(npos[0]), int(dpos[0]), int(sampled[0]), int(accepted[0])) == ref
    assert torch.equal(tokens, ref_tokens)
    a = min(match, k)
    assert ref == (pos + a + 1, pos + a, int(targets[a]), a) and int(ref_tokens[pos + a + 1]) == int(targets[a])


@pytest.mark.parametrize("dpos,n_prompt", [(9, 10), (8, 10), (3, 10), (14, 3)])
def test_draft_end_spec_begin_spec_end(dpos, n_prompt):
    """A draft lands two positions on unless that is a prompt position; the index is clamped."""
    s = 16
    tokens = torch.arange(s, dtype=torch.int32)
    ref_tokens = tokens.clone()
    slot = i32(dpos)
    interpret(draft_end_kernel)[(1,)](slot, i32(77), i32(n_prompt), tokens, slot, S=s)
    assert int(slot[0]) == draft_end_ref(dpos, 77, n_prompt, ref_tokens) == dpos + 1
    assert torch.equal(tokens, ref_tokens)
    assert (77 in ref_tokens.tolist()) == (dpos + 2 > n_prompt)
    vend = i32(-1)
    interpret(spec_begin_kernel)[(1,)](i32(dpos), vend, 4)
    assert int(vend[0]) == spec_begin_ref(dpos, 4) == dpos + 4
    pos, token = i32(-1), i32(-1)
    interpret(spec_end_kernel)[(1,)](i32(dpos), i32(33), pos, token)
    assert (int(pos[0]), int(token[0])) == spec_end_ref(dpos, 33) == (dpos, 33)


def _gdn_case(dims, rows, seed):
    hk, hv, dk, dv, kc = dims
    c = 2 * hk * dk + hv * dv
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    layer = {"conv_state": r(c, kc - 1), "conv_w": r(c, kc) * 0.5, "a_log": r(hv) * 0.5, "dt_bias": r(hv) * 0.5,
             "norm_w": 1.0 + 0.1 * r(dv), "rec_state": r(hv, dk, dv) * 0.3}
    z, qkv = 0, hv * dv  # projection rows [z | qkv | b | a | pad]
    b = qkv + c
    a = b + hv
    width = a + hv + 3
    return layer, r(rows, width), (width, z, qkv, b, a, c)


# (hk, hv, dk, dv, kc): grouped heads with several column blocks; non-power-of-two heads and 3 taps
SNAP_SHAPES = [(2, 4, 16, 16, 4), (1, 2, 12, 24, 3)]


def _snap_rows(block_m: int):
    """sm_90 with gdn_rows_norm_snap at ``block_m`` rows a program."""
    return dataclasses.replace(SM90, rules={**SM90.rules, "gdn_rows": dataclasses.replace(SM90.rules["gdn_rows"],
                                                                                          snap_norm_block_m=block_m)})


@pytest.mark.parametrize("dims", SNAP_SHAPES)
@pytest.mark.parametrize("valid,block_m", [(4, 1), (2, 1), (4, 16), (2, 2)])
def test_gdn_rows_snap_kernels_and_commit(dims, valid, block_m):
    """A 4-row verify with every row valid or 2: the verify's kernels against their references (outputs, the
    rows' updates, the conv state and its 3 snapshots; the recurrent state untouched), the references against the
    unfused gdn_rows_snap_ref, and the commit of each kept count against running only the kept rows; the norm's
    programs one row each (each then owning fewer conv channels), two, or all four."""
    hk, hv, dk, dv, kc = dims
    rows, pos, scale = 4, 6, dk ** -0.5
    layer, x, (width, z, qkv, b, a, c) = _gdn_case(dims, rows, seed=valid + hv)
    start = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    rec_rows = torch.full((rows, update_row_width(hk, hv, dk, dv)), float("nan"))
    conv_snap = torch.full((rows - 1, c, kc - 1), float("nan"))
    dl = gdn_rows_delta_launch(rows, width, hk, hv, dk, dv, kc, SM90, chunk=0)
    nl = gdn_rows_norm_launch(rows, width, hv, dv, c, kc, _snap_rows(block_m), snap=True)
    assert nl["grid"][:2] == [hv, rows // min(block_m, rows)]
    o_raw, out = torch.full((rows, hv * dv), float("nan")), torch.full((rows, hv * dv), float("nan"))
    interpret(gdn_rows_delta_snap_kernel)[tuple(dl["grid"])](
        x, layer["conv_state"], layer["conv_w"], layer["a_log"], layer["dt_bias"], layer["rec_state"], i32(pos),
        i32(pos + valid), rec_rows, o_raw, qkv, b, a, 1e-6, scale, **dl["constexprs"])
    interpret(gdn_rows_norm_snap_kernel)[tuple(nl["grid"])](
        o_raw, x, layer["norm_w"], layer["conv_state"], i32(pos), i32(pos + valid), conv_snap, out, z, qkv, 1e-6,
        **nl["constexprs"])
    assert torch.equal(layer["rec_state"], start["rec_state"])  # the verify leaves it to the commit
    ref = {k: start[k].clone() for k in start}
    r_rows, r_conv = torch.full_like(rec_rows, float("nan")), torch.full_like(conv_snap, float("nan"))
    o_ref = gdn_rows_delta_snap_ref(x, ref["conv_state"], layer["conv_w"], layer["a_log"], layer["dt_bias"],
                                    ref["rec_state"], pos, pos + valid, r_rows, qkv, b, a, 1e-6, scale)
    out_ref = gdn_rows_norm_snap_ref(o_ref, x, layer["norm_w"], ref["conv_state"], pos, pos + valid, r_conv, z, qkv,
                                     1e-6)
    n = min(valid, rows - 1)  # conv snapshots taken
    assert_close(o_raw, o_ref, 1e-5, 0.0, "o_raw")
    assert_close(out, out_ref, 1e-5, 0.0, "out")
    assert torch.equal(ref["rec_state"], start["rec_state"]) and torch.equal(layer["conv_state"], ref["conv_state"])
    assert_close(rec_rows[:valid], r_rows[:valid], 1e-5, 0.0, "the rows' updates")
    assert torch.equal(conv_snap[:n], r_conv[:n])
    assert torch.isnan(rec_rows[valid:]).all() and torch.isnan(conv_snap[n:]).all()  # nothing past the valid rows
    # the fused references = the unfused op
    u = {k: start[k].clone() for k in start}
    u_rows, u_conv = torch.full_like(rec_rows, float("nan")), torch.full_like(conv_snap, float("nan"))
    o_u = gdn_rows_snap_ref(x[:, qkv:qkv + c], x[:, b:b + hv], x[:, a:a + hv], u["conv_state"], layer["conv_w"],
                            layer["a_log"], layer["dt_bias"], u["rec_state"], pos, pos + valid, u_rows, u_conv, 1e-6,
                            scale)
    assert torch.equal(o_u, o_ref) and torch.equal(u_rows[:valid], r_rows[:valid])
    assert torch.equal(u_conv[:n], r_conv[:n])
    assert torch.equal(u["rec_state"], ref["rec_state"]) and torch.equal(u["conv_state"], ref["conv_state"])
    # the commit of each kept count == the states after only the kept rows (small blocks: several programs a state)
    cl = gdn_commit_launch(hk, hv, dk, dv, c, kc, rows, SM90)
    assert cl["grid"][0] * cl["constexprs"]["BLOCK"] >= max(hv * dk * dv, c * (kc - 1)) and cl["grid"][1] == 2
    grid = (-(-max(hv * dk * dv, c * (kc - 1)) // 64), 2)
    for kept in range(1, valid + 1):
        st = {k: v.clone() for k, v in layer.items() if k in ("conv_state", "rec_state")}
        interpret(gdn_commit_kernel)[grid](st["rec_state"], rec_rows, st["conv_state"], conv_snap, i32(pos),
                                           i32(pos + kept), **dict(cl["constexprs"], BLOCK=64))
        cm = {k: v.clone() for k, v in layer.items() if k in ("conv_state", "rec_state")}
        gdn_commit_ref(cm["rec_state"], r_rows, cm["conv_state"], r_conv, pos, pos + kept)
        only = {k: start[k].clone() for k in start}
        gdn_rows_ref(x[:, qkv:qkv + c], x[:, b:b + hv], x[:, a:a + hv], only["conv_state"], layer["conv_w"],
                     layer["a_log"], layer["dt_bias"], only["rec_state"], pos, pos + kept, 1e-6, scale)
        assert torch.equal(cm["rec_state"], only["rec_state"]), f"commit of {kept} rows (reference)"
        assert torch.equal(cm["conv_state"], only["conv_state"]) and torch.equal(st["conv_state"], only["conv_state"])
        assert_close(st["rec_state"], only["rec_state"], 1e-5, 0.0, f"commit of {kept} rows")


@pytest.mark.parametrize("dims", SNAP_SHAPES)
def test_gdn_rows_snap_and_commit_are_the_one_token_step_bit_for_bit(dims):
    """The verify's Gated DeltaNet kernel (gdn_rows_delta_snap) computes each row as the one-token step's
    gdn_delta does: the same conv sum over the window of taps and the output o = S^T q from the updated state,
    so its rows' outputs (raw and normed) equal K + 1 one-token steps bit for bit, and gdn_commit_kernel's state
    after r kept rows equals the one-token step's after r tokens (here in the interpreter; on the H200,
    bench/device_row_diff.py found the verify and the step ~1 ulp apart before this, bench/results/stop33 call 11)."""
    from kestrel.kernels.gated_delta import gdn_delta_kernel, gdn_delta_launch, gdn_norm_kernel, gdn_norm_launch

    hk, hv, dk, dv, kc = dims
    rows, pos, scale = 4, 6, dk ** -0.5
    layer, x, (width, z, qkv, b, a, c) = _gdn_case(dims, rows, seed=3 + hv)
    step = {k: layer[k].clone() for k in ("conv_state", "rec_state")}
    rec_rows = torch.full((rows, update_row_width(hk, hv, dk, dv)), float("nan"))
    conv_snap = torch.full((rows - 1, c, kc - 1), float("nan"))
    dl = gdn_rows_delta_launch(rows, width, hk, hv, dk, dv, kc, SM90, chunk=0)
    o_rows = torch.full((rows, hv * dv), float("nan"))
    interpret(gdn_rows_delta_snap_kernel)[tuple(dl["grid"])](
        x, layer["conv_state"], layer["conv_w"], layer["a_log"], layer["dt_bias"], layer["rec_state"], i32(pos),
        i32(pos + rows), rec_rows, o_rows, qkv, b, a, 1e-6, scale, **dl["constexprs"])
    rl = gdn_rows_norm_launch(rows, width, hv, dv, c, kc, SM90, snap=True)
    out_rows = torch.full((rows, hv * dv), float("nan"))
    conv_after = layer["conv_state"].clone()
    interpret(gdn_rows_norm_snap_kernel)[tuple(rl["grid"])](
        o_rows, x, layer["norm_w"], conv_after, i32(pos), i32(pos + rows), conv_snap, out_rows, z, qkv, 1e-6,
        **rl["constexprs"])
    sl, nl = gdn_delta_launch(hk, hv, dk, dv, kc, SM90), gdn_norm_launch(hv, dv, c, kc, SM90)
    cl = gdn_commit_launch(hk, hv, dk, dv, c, kc, rows, SM90)
    for r in range(rows):
        o, out = torch.full((hv * dv,), float("nan")), torch.full((hv * dv,), float("nan"))
        xr = x[r].clone()
        interpret(gdn_delta_kernel)[tuple(sl["grid"])](
            xr[qkv:qkv + c], xr[b:b + hv], xr[a:a + hv], step["conv_state"], layer["conv_w"], layer["a_log"],
            layer["dt_bias"], step["rec_state"], o, 1e-6, scale, **sl["constexprs"])
        interpret(gdn_norm_kernel)[tuple(nl["grid"])](  # (shifts the conv state for the next row)
            o, xr[z:z + hv * dv], xr[qkv:qkv + c], layer["norm_w"], step["conv_state"], out, 1e-6,
            **nl["constexprs"])
        assert torch.equal(o_rows[r], o), f"row {r}: o_raw differs from the one-token step's"
        assert torch.equal(out_rows[r], out), f"row {r}: the normed output differs from the one-token step's"
        rec, conv = layer["rec_state"].clone(), conv_after.clone()
        interpret(gdn_commit_kernel)[tuple(cl["grid"])](rec, rec_rows, conv, conv_snap, i32(pos), i32(pos + r + 1),
                                                        **cl["constexprs"])
        assert torch.equal(rec, step["rec_state"]), f"{r + 1} kept rows: the state differs from the one-token step's"
        assert torch.equal(conv, step["conv_state"]), f"{r + 1} kept rows: the conv window differs"


# --- AOT: every new kernel for every GPU target, in one clean process --------------------------------

def aot_jobs():
    """(key, module:function, param types, constexprs, num_warps, cc, fp_fusion) at the 27B shapes, K = 3; on
    sm_90 the verify's Gated DeltaNet kernels also as the rule ``gdn_delta.fp_fusion=False`` launches them."""
    jobs = []
    nofuse = dataclasses.replace(TARGETS["sm_90"], rules={**TARGETS["sm_90"].rules, "gdn_delta": dataclasses.replace(
        TARGETS["sm_90"].rules["gdn_delta"], fp_fusion=False)})
    for name in [n for n in ALL_TARGETS if n != "cpu"] + ["sm_90/nofuse"]:
        t = nofuse if name == "sm_90/nofuse" else TARGETS[name]
        cat = concat_launch(1, 5120, 5120, t)
        nxt = embedding_rows_launch(4, 5120, 4096, t)
        am = argmax_rows_launch(4, 248320, t)
        hk, hv, dk, dv, kc, c, width = 16, 48, 128, 128, 4, 10240, 10240 + 48 * 128 + 96
        dl = gdn_rows_delta_launch(4, width, hk, hv, dk, dv, kc, t, chunk=0, snap=True)
        nl = gdn_rows_norm_launch(4, width, hv, dv, c, kc, t, snap=True)
        cl = gdn_commit_launch(hk, hv, dk, dv, c, kc, 4, t)
        sr = spec_rows_launch(4, 248320, t)
        ds = spec_rows_launch(1, 248320, t)
        sf = spec_filter_launch(4, 248320, t)
        one = t.rules["step_end"].num_warps
        mod = "kestrel.kernels."
        for key, fn, types, consts, warps in [
            ("concat", "mtp:concat_kernel", ["*fp32"] * 3, cat["constexprs"], cat["num_warps"]),
            ("embedding_next_rows_bf16", "embedding:embedding_next_rows_kernel",
             ["*bf16", "*i32", "*i32", "*i32", "*i32", "*fp32", "i32"], nxt["constexprs"], nxt["num_warps"]),
            ("spec_begin", "speculative:spec_begin_kernel", ["*i32", "*i32", "i32"], {}, one),
            ("argmax_rows", "speculative:argmax_rows_kernel", ["*fp32", "*i32"], am["constexprs"], am["num_warps"]),
            ("accept", "speculative:accept_kernel", ["*i32"] * 7, {"R": 4, "S": 4096, "BLOCK_R": 4}, one),
            ("draft_end", "speculative:draft_end_kernel", ["*i32"] * 5, {"S": 4096}, one),
            ("spec_end", "speculative:spec_end_kernel", ["*i32"] * 4, {}, one),
            ("gdn_rows_delta_snap", "gated_delta:gdn_rows_delta_snap_kernel",
             ["*fp32"] * 6 + ["*i32"] * 2 + ["*fp32"] * 2 + ["i32"] * 3 + ["fp32"] * 2, dl["constexprs"],
             dl["num_warps"]),
            ("gdn_rows_norm_snap", "gated_delta:gdn_rows_norm_snap_kernel",
             ["*fp32"] * 4 + ["*i32"] * 2 + ["*fp32"] * 2 + ["i32"] * 2 + ["fp32"], nl["constexprs"], nl["num_warps"]),
            ("gdn_commit", "gated_delta:gdn_commit_kernel", ["*fp32"] * 4 + ["*i32"] * 2, cl["constexprs"],
             cl["num_warps"]),
            ("spec_filter", "speculative:spec_filter_kernel",
             ["*fp32", "*fp32", "*fp32", "*i32", "*fp32", "*fp32", "*i32"], sf["constexprs"], sf["num_warps"]),
            ("draft_sample", "speculative:draft_sample_kernel",
             ["*fp32", "*i32", "*fp32", "*fp32", "*i32", "*fp32", "*i32", "*i32", "*fp32", "*fp32", "*i32", "*i32",
              "i32"], ds["constexprs"], ds["num_warps"]),
            ("spec_sample_rows", "speculative:spec_sample_rows_kernel",
             ["*fp32", "*i32", "*fp32", "*i32", "*i32", "*i32", "*fp32", "*fp32", "*i32", "*fp32", "*i32", "*i32",
              "*fp32", "*i32", "*i32"], {**sr["constexprs"], "K": 3, "S": 4096}, sr["num_warps"]),
            ("replay_drafts", "speculative:replay_drafts_kernel",
             ["*i32", "*i32", "*fp32", "*i32", "*i32", "*i32", "i32", "i32"], {"S": 4096, "BLOCK_R": 4}, one),
        ]:
            launch = {"gdn_rows_delta_snap": dl, "gdn_rows_norm_snap": nl, "gdn_commit": cl}.get(key, {})
            if name != "sm_90/nofuse" or launch:
                jobs.append([f"{key}/{name}", mod + fn, types, consts, warps, t.cc, launch.get("fp_fusion", True)])
    return jobs


_COMPILE_ALL = """
import json, sys
from kestrel.compiler.codegen import compile_kernel
res = {}
for key, fn, types, consts, num_warps, cc, fusion in json.loads(sys.stdin.read()):
    try:
        ck = compile_kernel(key.split("/")[0], fn, types, consts, num_warps, cc, [t.startswith("*") for t in types],
                            fusion)
        res[key] = [len(ck.cubin), ck.num_warps, ck.arch, ck.shared, ck.cubin[:4].hex()]
    except Exception as e:  # reported per (kernel, target) by the test
        res[key] = repr(e)[-2000:]
print(json.dumps(res))
"""


# the jobs split between clean processes started with the module, beside its interpreter tests
_aot = split_compile_fixture(_COMPILE_ALL, aot_jobs, "test_aot_compiles_every_speculative_kernel")


@pytest.fixture(scope="module")
def compiled(_aot):
    return _aot.compiled()


def test_aot_compiles_every_speculative_kernel_for_every_target(compiled):
    jobs = aot_jobs()
    assert len(jobs) == 14 * (len(ALL_TARGETS) - 1) + 3
    assert [(j[0], j[-1]) for j in jobs if j[-1] is False] == [("gdn_rows_delta_snap/sm_90/nofuse", False),
                                                             ("gdn_rows_norm_snap/sm_90/nofuse", False),
                                                             ("gdn_commit/sm_90/nofuse", False)]
    for key, fn, types, consts, warps, cc, _ in jobs:
        res = compiled[key]
        assert isinstance(res, list), f"{key}: {res}"
        size, num_warps, arch, shared, magic = res
        assert size > 0 and magic == "7f454c46" and num_warps == warps and arch.startswith(f"sm_{cc}"), key
    # every op kind of the speculative family is covered, with the kernel its record names
    kinds = {"concat", "embedding_next_rows", "spec_begin", "argmax_rows", "accept", "draft_end", "spec_end",
             "gdn_rows_delta_snap", "gdn_rows_norm_snap", "gdn_commit", "spec_filter", "draft_sample",
             "spec_sample_rows", "replay_drafts"}
    for kind in kinds:
        jit = OPS[kind].kernel.jit
        assert any(fn.endswith(":" + jit.fn.__name__) for _, fn, *_ in jobs), kind
