"""The ONNX step (compiler/onnx_export.py) against Kestrel's CPU reference, and the TensorRT backend's
behaviour where TensorRT is missing (runtime/tensorrt.py; its engine test runs only where it imports).

The check: the tiny preset's program (lower + fuse + quantize) exported to ONNX and run in onnxruntime
(CPU) for 16 greedy steps, states fed back, against runtime/cpu.py CpuStep on the same program and
weights: the same tokens at every step, and every step's logits within 1e-4 (fp32; 5e-4 with bf16 KV
caches) of the reference relative to the largest logit (max |d| / max |logit|). Measured: fp32 1.9e-6; q4 3.8e-6; bf16 5.3e-5 — bf16
KV caches: an fp32 difference of ~1e-7 in k (onnxruntime's and torch's reduction orders differ)
flips the bf16 rounding of one cache element by one ulp at one step, the rest is bit-identical.
The same for tiny-next (Qwen3-Next: every MLP a routed MoE block), with every layer's routed experts
(the graph's TopK ids) equal to the CPU path's routing buffers at every step.
"""
import copy
import importlib.util
import os

import numpy as np
import pytest

from conftest import run_cli

import onnx  # noqa: E402  (in the test extra: a missing install must fail, not skip)
import onnxruntime as ort  # noqa: E402

PROMPT = list(b"Hello")
STEPS = 16
MAX_SEQ = 32
TOL = 1e-4  # fp32 (the bar)
# bf16 KV caches (--quant bf16 and q4): one ulp of one cache element may flip (see above), worth ~5e-5
TOL_BF16_CACHE = 5e-4
# q4: the ONNX step multiplies the dequantised weights in fp32; Kestrel's q4 product (kernels/matvec.py)
# rounds x / 64 to fp16 and sums each word's lanes in fp16 (~3e-4 of a product's magnitude), which
# compounds over the layers: measured 2.0e-3 on this model
TOL_Q4 = 4e-3
# tiny-next in q4: the same fp16 lanes in four MoE blocks (the router stays bf16, the routing equal at every
# step and layer, asserted separately): measured 7.4e-3 at one step of 16, 1.2-3.3e-3 at the others
TOL_Q4_NEXT = 1.5e-2
HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


def _tiny(quant: str, preset: str = "tiny"):
    """(program, plan-layout weight bytes by name, ModelProto, StepSignature) for a tiny preset."""
    from kestrel.compiler.build import open_model, step_program
    from kestrel.compiler.onnx_export import export_program
    from kestrel.compiler.weights import weight_bytes

    with open_model(preset, MAX_SEQ) as m:
        prog = step_program(m.cfg, MAX_SEQ, quant)
        raw = {n: bytes(weight_bytes(w, m.ck.read)) for n, w in prog.weights.items()}
    model, sig = export_program(prog, lambda n: raw[n])
    return prog, raw, model, sig


@pytest.fixture(scope="module", params=[(p, q) for p in ("tiny", "tiny-next") for q in ("none", "bf16", "q4")] +
                # Qwen3.5 MoE (unfused GDN projections, MoE blocks): fp32 here; its q4 routing is checked below (two
                # near-tie swaps in 64 routings move its q4 logits by up to 0.14 at those steps, 1e-3 at the others)
                [("tiny-moe", "none")],
                ids=lambda pq: "-".join(pq))
def exported(request):
    preset, quant = request.param
    return (quant, *_tiny(quant, preset))


def _ort_value(dtype: str, array: np.ndarray):
    from onnx import TensorProto

    if dtype == "bf16":  # numpy has no bfloat16: hand onnxruntime the raw 16-bit words
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.astype(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(array)


def ort_decode(session, sig, prompt, steps):
    """Greedy decoding with the ONNX step: states fed back, next_token fed in. Per step: (token, logits)."""
    states = {i: _ort_value(sig.inputs[i][0], np.zeros(sig.inputs[i][1], np.float32)) for i, _ in sig.states}
    names = ["logits", "next_token"] + [o for _, o in sig.states]
    out, tok = [], prompt[0]
    for pos in range(steps):
        tok = prompt[pos] if pos < len(prompt) else tok
        feeds = {"token": _ort_value("i64", np.array([tok], np.int64)),
                 "pos": _ort_value("i64", np.array([pos], np.int64)), **states}
        res = dict(zip(names, session.run_with_ort_values(names, feeds)))
        states = {i: res[o] for i, o in sig.states}
        tok = int(res["next_token"].numpy()[0])
        out.append((tok, res["logits"].numpy()))
    return out


def cpu_decode(prog, raw, prompt, steps):
    """The same with Kestrel's CPU reference path on the same program and weights."""
    from kestrel.runtime.cpu import CpuStep, weight_tensor

    step = CpuStep(program=prog, weights={n: weight_tensor(raw[n], w) for n, w in prog.weights.items()},
                   max_seq=MAX_SEQ)
    out, tok = [], prompt[0]
    for pos in range(steps):
        step.dyn["token"] = prompt[pos] if pos < len(prompt) else tok
        step.dyn["pos"] = pos
        step.run()
        tok = int(step.dyn["sampled"])
        out.append((tok, step.output("logits")))
    return out


def session(model):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_onnx_step_matches_cpu_reference(exported):
    quant, prog, raw, model, sig = exported
    got = ort_decode(session(model), sig, PROMPT, STEPS)
    want = cpu_decode(prog, raw, PROMPT, STEPS)
    assert [t for t, _ in got] == [t for t, _ in want], f"{quant}: greedy tokens differ"
    worst = max(float(np.abs(a - b).max() / np.abs(b).max()) for (_, a), (_, b) in zip(got, want))
    print(f"{quant}: max |dlogits| / max |logit| over {STEPS} steps = {worst:.2e}")
    moe = any(op.kind == "moe_topk" for op in prog.ops)
    tol = {"none": TOL, "q4": TOL_Q4_NEXT if moe else TOL_Q4}.get(quant, TOL_BF16_CACHE)
    assert worst <= tol, f"{quant}: logits differ by {worst:.2e} (relative to the largest logit)"


@pytest.mark.parametrize("preset", ["tiny-next", "tiny-moe"])
@pytest.mark.parametrize("quant", ["none", "q4"])
def test_onnx_moe_routes_as_the_cpu_reference(quant, preset):
    """tiny-next and tiny-moe (Qwen3.5 MoE): every layer's routed experts (the ids the graph's TopK gives, read out as extra outputs)
    equal the CPU path's routing buffers at every step, in rank order. In q4 the graph multiplies the
    dequantised weights in fp32 and the CPU path as the GPU does (fp16 lanes), ~3e-3 apart, so near-tied
    experts may trade places: there each rank's expert must be one whose CPU probability is within 1% of the
    CPU path's choice (measured: tiny-next one swap in 64 routings, 0.3122 against 0.3100; tiny-moe two)."""
    import torch
    from onnx import TensorProto, helper

    from kestrel.runtime.cpu import CpuStep, weight_tensor

    prog, raw, model, sig = _tiny(quant, preset)
    topks = [(i, op) for i, op in enumerate(prog.ops) if op.kind == "moe_topk"]
    assert len(topks) == 4
    k = topks[0][1].attrs["top_k"]
    ids = []
    for i, _ in topks:  # the Cast of TopK's indices to the IR's i32 in that op's scope
        cast = [n for n in model.graph.node if n.name.startswith(f"op{i}.moe_topk/") and n.op_type == "Cast"
                and n.input[0].endswith(".1")]
        assert len(cast) == 1
        ids.append(cast[0].output[0])
        model.graph.output.append(helper.make_tensor_value_info(ids[-1], TensorProto.INT32, [k]))
    sess = session(model)
    step = CpuStep(program=prog, weights={n: weight_tensor(raw[n], w) for n, w in prog.weights.items()},
                   max_seq=MAX_SEQ)
    states = {i: _ort_value(sig.inputs[i][0], np.zeros(sig.inputs[i][1], np.float32)) for i, _ in sig.states}
    names = ["next_token"] + ids + [o for _, o in sig.states]
    tok, distinct, swaps = PROMPT[0], set(), 0
    for pos in range(STEPS):
        tok = PROMPT[pos] if pos < len(PROMPT) else tok
        res = dict(zip(names, sess.run_with_ort_values(names, {
            "token": _ort_value("i64", np.array([tok], np.int64)), "pos": _ort_value("i64", np.array([pos], np.int64)),
            **states})))
        states = {i: res[o] for i, o in sig.states}
        step.dyn["token"], step.dyn["pos"] = tok, pos
        step.run()
        for (_, op), name in zip(topks, ids):
            got, want = res[name].numpy().tolist(), step.values[id(op.outs[0])].tolist()
            why = f"{quant}: step {pos}, {op.outs[0]}: ONNX routes to {got}, the CPU path to {want}"
            if quant == "q4" and got != want:
                probs = torch.softmax(step.values[id(op.ins[0])].float(), -1)
                assert all(abs(probs[g] - probs[w]) <= 0.01 * probs[w] for g, w in zip(got, want)), why
                swaps += 1
            else:
                assert got == want, why
            distinct.add(tuple(got))
        tok = int(res["next_token"].numpy()[0])
        assert tok == int(step.dyn["sampled"])
    assert len(distinct) > 4  # the routing changes from token to token
    assert swaps <= 2, f"{quant}: {swaps} near-tie swaps in {STEPS * len(topks)} routings"


@pytest.mark.parametrize("norm_topk", [0, 1])
def test_onnx_topk_breaks_ties_as_the_reference(norm_topk):
    """moe_topk's ONNX form alone, over logits with ties among the largest (where torch.topk on the CPU
    puts a higher index first, tests/test_kernels_moe.py): onnxruntime's ids are the reference's, lower
    index first, and the weights equal it."""
    import torch
    from onnx import TensorProto, helper

    from kestrel.compiler.ir import Op, TensorType, Value
    from kestrel.compiler.onnx_export import OPSET, _Exporter
    from kestrel.compiler.ops import OPS
    from kestrel.kernels.moe import moe_topk_ref

    logits = torch.zeros(2, 16)
    logits[0, [3, 5, 9, 11]] = 1.0
    logits[1, 12:16] = 2.0
    logits[1, 0] = 3.0
    x = Value(TensorType("f32", (2, 16)))
    op = Op("moe_topk", [Value(TensorType("i32", (2, 3))), Value(TensorType("f32", (2, 3)))], [x],
            {"top_k": 3, "norm_topk": norm_topk})
    ex = _Exporter(None, None)
    ex.env[id(x)] = "logits"
    ids, weights = OPS["moe_topk"].onnx(ex, op, x)
    graph = helper.make_graph(ex.g.nodes, "topk", [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info(ids, TensorProto.INT32, [2, 3]),
                               helper.make_tensor_value_info(weights, TensorProto.FLOAT, [2, 3])],
                              initializer=ex.g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    got_ids, got_w = session(model).run([ids, weights], {"logits": logits.numpy()})
    want_ids, want_w = moe_topk_ref(logits, 3, norm_topk)
    assert got_ids.tolist() == want_ids.tolist() == [[3, 5, 9], [0, 12, 13]]
    np.testing.assert_allclose(got_w, want_w.numpy(), rtol=1e-6)


@pytest.mark.parametrize("form", ["int4", "nibbles"])
def test_q4_onnx_codes_are_the_plans(monkeypatch, form):
    """q4_onnx_data: a q4 matrix's codes (two a byte, the first in the low nibble: INT4's q - 8, or the expert
    stacks' unsigned q) and fp32 scales,
    made by q4_codes a band of rows at a time (bounded memory at 80B-A3B's 0.5 G-element expert stacks; here
    bands of 3 rows of 11), dequantise to q4_unpack's values."""
    import torch

    from kestrel.compiler import onnx_export
    from kestrel.compiler.ir import TensorType, Weight
    from kestrel.kernels import matvec
    from kestrel.kernels.matvec import q4_pack, q4_unpack

    n, k, group = 11, 64, 32
    buf = q4_pack(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), group)
    w = Weight("w", TensorType(f"q4g{group}", (n, k)))
    want = q4_unpack(buf, n, k, group).numpy()  # in one band
    monkeypatch.setattr(matvec, "Q4_CODES_BAND", 3 * k)
    codes, scales = onnx_export.q4_onnx_data(w, buf.numpy().tobytes(), form)
    got = np.frombuffer(codes, dtype=np.uint8)
    got = np.stack([got & 15, got >> 4], -1).reshape(-1).astype(np.int8)  # low nibble first
    if form == "int4":  # two's complement nibbles
        got = np.where(got > 7, got - 16, got).astype(np.int8)
    else:
        got = got - 8
    got_s = np.frombuffer(scales, dtype=np.float32).reshape(n, k // group)
    deq = got.reshape(n, k // group, group).astype(np.float32) * got_s[:, :, None]
    assert np.array_equal(deq.reshape(n, k), want)
    assert got.min() >= -8 and got.max() <= 7 and len(np.unique(got)) > 8


def test_onnx_step_passes_checker_and_strict_shape_inference(exported):
    quant, prog, _, model, sig = exported
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    assert [i.name for i in model.graph.input][:2] == ["token", "pos"]
    outs = {o.name: o for o in inferred.graph.output}
    vocab = prog.outputs["logits"].type.shape[0]
    assert [d.dim_value for d in outs["logits"].type.tensor_type.shape.dim] == [vocab]
    assert set(outs) == {"logits", "hidden", "next_token"} | {o for _, o in sig.states}
    kv = [i for i in model.graph.input if i.name.endswith("k_cache")]
    assert kv and all(i.type.tensor_type.shape.dim[0].dim_value == MAX_SEQ for i in kv)
    want = onnx.TensorProto.FLOAT if quant == "none" else onnx.TensorProto.BFLOAT16
    assert all(i.type.tensor_type.elem_type == want for i in kv)
    from kestrel.compiler.ir import q4_group

    init = {t.name: t for t in model.graph.initializer}
    T = onnx.TensorProto
    for w in prog.weights.values():  # bf16 kept as BFLOAT16; q4 as 4-bit codes (expert stacks: nibble pairs) + scales
        t = init[w.name]
        if w.type.dtype.startswith("q4"):
            n, k = w.type.shape
            if ".mlp.experts." in w.name:
                assert t.data_type == T.UINT8 and list(t.dims) == [n, k // 2]
            else:
                assert t.data_type == T.INT4 and list(t.dims) == [n, k]
            assert len(t.raw_data) == n * k // 2
            scale = init[w.name + ".scale"]
            assert scale.data_type == T.FLOAT and list(scale.dims) == [n, k // q4_group(w.type.dtype)]
        else:
            assert t.data_type == (T.BFLOAT16 if w.type.dtype == "bf16" else T.FLOAT)
    assert any(w.type.dtype.startswith("q4") for w in prog.weights.values()) == (quant == "q4")
    assert model.opset_import[0].version == (21 if quant == "q4" else 17)  # INT4 and block_size: opset 21


def _with_gdn_step(prog):
    """The fused program with each gdn_delta + gdn_norm pair merged into one gdn_step (valid IR that
    fuse does not emit; its CPU reference composes the same single-op references)."""
    from kestrel.compiler.ir import Op
    from kestrel.compiler.ops import verify

    ops = list(prog.ops)
    for delta in [op for op in ops if op.kind == "gdn_delta"]:
        norm = next(op for op in ops if op.kind == "gdn_norm" and op.ins[0] is delta.outs[0])
        qkv, b, a, conv_state, conv_w, a_log, dt_bias, rec = delta.ins
        _, z, _, norm_w, _ = norm.ins
        ops[ops.index(norm)] = Op("gdn_step", norm.outs, [qkv, z, b, a, conv_state, conv_w, a_log, dt_bias, norm_w,
                                                          rec], {"eps": norm.attrs["eps"], **delta.attrs})
        ops.remove(delta)
    prog.ops = ops
    verify(prog)
    return prog


def _fused_without(prog, rewrite: str):
    """``prog`` through every fuse rewrite but the one named (valid IR; e.g. without "norm into matmuls"
    the one-row MLPs keep matmul_swiglu)."""
    from kestrel.compiler.ops import verify
    from kestrel.passes import fuse

    p = copy.deepcopy(prog)
    for name, run in fuse.REWRITES:
        if name != rewrite:
            run(p)
    verify(p)
    return p


def test_every_op_kind_before_hoist_dynamic_matches_cpu_reference():
    """The unfused lowering (quantize only), one fused but for the norms folded into the matmuls and the fused
    one (tiny's with gdn_step), of tiny and of tiny-next, cover every op kind but step_end."""
    from kestrel.compiler.build import open_model
    from kestrel.compiler.onnx_export import export_program
    from kestrel.compiler.ops import OPS
    from kestrel.compiler.qwen3_5 import lower
    from kestrel.compiler.weights import weight_bytes
    from kestrel.passes.quantize import quantize

    programs = []
    for preset in ("tiny", "tiny-next"):
        with open_model(preset, MAX_SEQ) as m:
            unfused = quantize(lower(m.cfg, MAX_SEQ), "none")
            raw = {n: bytes(weight_bytes(w, m.ck.read)) for n, w in unfused.weights.items()}
        fused, fused_raw, _, _ = _tiny("none", preset)
        programs += [(unfused, raw), (_fused_without(unfused, "norm into matmuls"), fused_raw)]
        programs.append((_with_gdn_step(fused) if preset == "tiny" else fused, fused_raw))
    kinds = set()
    for prog, weights in programs:
        kinds |= {op.kind for op in prog.ops}
        model, sig = export_program(prog, lambda n: weights[n])
        got, want = ort_decode(session(model), sig, PROMPT, 8), cpu_decode(prog, weights, PROMPT, 8)
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(float(np.abs(a - b).max() / np.abs(b).max()) for (_, a), (_, b) in zip(got, want)) <= TOL
    # gdn_delta / gdn_norm: the fused program of test_onnx_step_matches_cpu_reference; step_end: after
    # hoist_dynamic; the M-row step's and the speculative programs' ops have no ONNX form (the ONNX step is
    # the one-token step; the grouped MoE ops run only at M rows)
    no_onnx = {name for name, d in OPS.items() if not callable(d.onnx)}
    assert no_onnx == {"step_end", "embedding_rows", "gdn_rows", "attn_rows", "last_row", "chunk_last", "prefill_end",
                       "gdn_rows_delta", "gdn_rows_norm", "attn_rows_kv", "attn_rows_q",
                       "concat", "embedding_next_rows", "spec_begin", "argmax_rows", "accept", "draft_end", "spec_end",
                       "gdn_rows_snap", "gdn_rows_delta_snap", "gdn_rows_norm_snap", "gdn_commit",
                       "spec_filter", "draft_sample", "spec_sample_rows", "replay_drafts",
                       "moe_group", "moe_gate_up_grouped", "moe_down_grouped", "moe_combine"}
    assert kinds | {"gdn_delta", "gdn_norm"} | no_onnx == set(OPS)


def test_unused_states_and_dyn_slots_stay_out_of_the_graph():
    """A state no op touches (like the runtime's token sequence) and a dyn slot no op reads are ignored."""
    from kestrel.compiler.onnx_export import export_program

    prog, raw, _, _ = _tiny("none")
    prog.add_state("unused_sequence", "i32", (MAX_SEQ,))
    prog.add_dyn("unused_count", "i32", host=True)
    model, sig = export_program(prog, lambda n: raw[n])
    names = {i.name for i in model.graph.input} | {o.name for o in model.graph.output}
    assert not any(n.startswith("unused") for n in names)
    assert "unused_sequence" not in sig.inputs


def test_program_after_hoist_dynamic_is_refused():
    from kestrel.artifacts.errors import UnsupportedError
    from kestrel.compiler.onnx_export import export_program
    from kestrel.passes.hoist_dynamic import hoist_dynamic

    prog, raw, _, _ = _tiny("none")
    with pytest.raises(UnsupportedError, match="before hoist_dynamic"):
        export_program(hoist_dynamic(prog), lambda n: raw[n])


@pytest.mark.parametrize("preset,quant", [("tiny", "none"), ("tiny-next", "q4")])
def test_external_data_gives_the_same_step(tmp_path, preset, quant):
    from kestrel.compiler.build import export_onnx as export

    out = str(tmp_path / "step.onnx")
    r = export(preset, out, quant=quant, max_seq=MAX_SEQ, external=True, log=lambda m: None)
    _, _, model, sig = _tiny(quant, preset)
    weights = sum(len(t.raw_data) for t in model.graph.initializer if not t.name.startswith("const."))
    assert r.data_path == out + ".data" and os.path.getsize(r.data_path) >= weights > 300_000
    assert os.path.getsize(out) < 200_000  # the model refers to the weights, it does not hold them
    s = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    a = ort_decode(s, r.signature, PROMPT, 2)
    b = ort_decode(session(model), sig, PROMPT, 2)
    assert all(ta == tb and np.array_equal(la, lb) for (ta, la), (tb, lb) in zip(a, b))


def test_cli_export_onnx(tmp_path):
    out = tmp_path / "x.onnx"
    r = run_cli("kestrelc", "export-onnx", "tiny", "-o", str(out), "--max-seq", "64")
    assert r.returncode == 0, r.stderr
    assert "onnx.checker: ok" in r.stderr
    onnx.checker.check_model(str(out), full_check=True)
    assert not os.path.exists(str(out) + ".data")


@pytest.mark.skipif(HAVE_TRT, reason="tensorrt is installed here: the engine test covers this path")
def test_build_backend_tensorrt_without_tensorrt(tmp_path):
    from kestrel.artifacts.errors import BackendMissingError

    plan = tmp_path / "m.plan"
    r = run_cli("kestrelc", "build", "tiny", "--backend", "tensorrt", "--target", "sm_90", "-o", str(plan))
    assert r.returncode == BackendMissingError.exit_code == 9, r.stderr
    errors = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and "TensorRT is not installed" in errors[0] and "m.onnx" in errors[0], r.stderr
    assert "Traceback" not in r.stderr
    assert (tmp_path / "m.onnx").exists() and not plan.exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    onnx.checker.check_model(str(tmp_path / "m.onnx"), full_check=True)


def test_build_backend_tensorrt_needs_a_gpu_target(tmp_path):
    r = run_cli("kestrelc", "build", "tiny", "--backend", "tensorrt", "-o", str(tmp_path / "m.plan"))
    assert r.returncode == 7 and r.stderr.startswith("error: --backend tensorrt"), r.stderr
    assert not os.listdir(tmp_path)  # nothing written


@pytest.mark.skipif(not HAVE_TRT, reason="tensorrt is not installed here")
def test_tensorrt_engine_plan_matches_cpu_reference(tmp_path):
    """Where TensorRT and a GPU exist: build an engine plan, run it with TrtStep, compare with the CPU path."""
    from kestrel.artifacts.errors import DeviceError
    from kestrel.artifacts.plan import load_plan
    from kestrel.compiler.build import build_tensorrt
    from kestrel.compiler.tensorrt_build import gpu_compute_capability
    from kestrel.kernels.targets import ALL_TARGETS
    from kestrel.runtime import tensorrt as rt

    try:
        cc = gpu_compute_capability("test")
    except DeviceError as e:
        pytest.skip(f"no CUDA GPU here ({e})")
    target = f"sm_{cc}"
    if target not in ALL_TARGETS:
        pytest.skip(f"GPU sm_{cc} is not a Kestrel target")
    plan_path = str(tmp_path / "m.plan")
    build_tensorrt("tiny", plan_path, target, quant="none", max_seq=MAX_SEQ, log=lambda m: None)
    plan = load_plan(plan_path)
    assert plan.backend == "tensorrt" and plan.manifest["tensorrt_version"]
    prog, raw, _, _ = _tiny("none")
    want = cpu_decode(prog, raw, PROMPT, STEPS)
    for use_graph in (False, True):
        step = rt.TrtStep(plan, use_graph=use_graph)
        step.reset()
        got, tok = [], PROMPT[0]
        for pos in range(STEPS):
            step.dyn["token"] = PROMPT[pos] if pos < len(PROMPT) else tok
            step.run()
            tok = int(step.dyn["sampled"])
            got.append((tok, step.output("logits")))
        assert [t for t, _ in got] == [t for t, _ in want]
        assert max(float(np.abs(a - b).max() / np.abs(b).max()) for (_, a), (_, b) in zip(got, want)) <= TOL


def _engine_plan(path: str, tensorrt_version: str) -> str:
    """A plan laid out as build --backend tensorrt writes it, with placeholder engine bytes."""
    from kestrel.artifacts.plan import PlanInfo, write_plan
    from kestrel.compiler.ir_text import print_program
    from kestrel.artifacts.plan import ENGINE_PART

    from kestrel.compiler.frontend import parse_config
    from kestrel.compiler.presets import PRESETS

    prog, _, _, sig = _tiny("none")
    model = parse_config(PRESETS["tiny"], "preset tiny").to_json()
    info = PlanInfo(target="sm_90", quant="none", max_seq=MAX_SEQ, model=model, source={"kind": "preset", "name": "tiny"},
                    extra={"backend": "tensorrt", "tensorrt_version": tensorrt_version, "compute_capability": "9.0",
                           "tensorrt": {"engine_part": ENGINE_PART, "signature": sig.to_json()}})
    write_plan(path, info, print_program(prog), [], None, extra_parts={ENGINE_PART: b"not an engine"})
    return path


def test_engine_plan_errors_are_one_line(tmp_path, monkeypatch):
    """Without TensorRT, with another TensorRT version, and without a GPU: each a clear one-line error."""
    import sys
    import types

    from kestrel.artifacts.errors import ArtifactError, BackendMissingError, DeviceError
    from kestrel.artifacts.plan import load_plan
    from kestrel.runtime.tensorrt import TrtStep

    plan = load_plan(_engine_plan(str(tmp_path / "e.plan"), "10.9.0"))
    assert plan.backend == "tensorrt" and plan.manifest["compute_capability"] == "9.0"
    if not HAVE_TRT:
        with pytest.raises(BackendMissingError, match="TensorRT is not installed"):
            TrtStep(plan)
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.3.0"))
    with pytest.raises(ArtifactError, match=r"built by TensorRT 10\.9\.0, this machine has 10\.3\.0") as e:
        TrtStep(plan)
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "tensorrt", types.SimpleNamespace(__version__="10.9.0"))
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return
    try:
        TrtStep(plan)
    except DeviceError as e:  # no driver here; on a GPU machine other than sm_90: built for compute capability 9.0
        assert "\n" not in str(e) and ("no usable GPU" in str(e) or "compute capability 9.0" in str(e))
    except AttributeError:  # a GPU of cc 9.0 and the stub module: past every check this test is about
        pass


def test_kestrel_run_on_an_engine_plan(tmp_path):
    """kestrel-run routes engine plans to the TensorRT runner: clear errors for what it cannot do."""
    from kestrel.artifacts.errors import BackendMissingError, UnsupportedError

    path = _engine_plan(str(tmp_path / "e.plan"), "10.9.0")
    for extra in (["--device", "cpu"], ["--bench"], ["--verify"]):
        r = run_cli("kestrel-run", path, "--prompt-ids", "1,2", "--max-new-tokens", "4", *extra)
        assert r.returncode == UnsupportedError.exit_code and "TensorRT engine" in r.stderr, (extra, r.stderr)
    if not HAVE_TRT:
        r = run_cli("kestrel-run", path, "--prompt-ids", "1,2", "--max-new-tokens", "4")
        assert r.returncode == BackendMissingError.exit_code and "TensorRT is not installed" in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_export_shows_progress_over_every_weight(tmp_path, monkeypatch):
    """export-onnx is long work at real sizes (a 27B checkpoint read, made q4 and written): a progress bar over the
    weights' bytes, as the build's (tqdm hides it off a terminal), advanced by every weight to the total."""
    from kestrel.compiler import build

    bars = []

    class Bar:
        def __init__(self, total, disable=None, **kw):
            self.total, self.done, self.disable, self.closed = total, 0, disable, False
            bars.append(self)

        def update(self, n):
            self.done += n

        def close(self):
            self.closed = True

    monkeypatch.setattr(build, "tqdm", Bar)
    build.export_onnx("tiny-next", str(tmp_path / "x.onnx"), quant="q4", max_seq=MAX_SEQ, log=lambda m: None)
    build.export_onnx("tiny", str(tmp_path / "y.onnx"), max_seq=MAX_SEQ, log=lambda m: None, progress=False)
    assert [b.disable for b in bars] == [None, True] and all(b.closed for b in bars)
    assert all(b.done == b.total > 1e5 for b in bars)
