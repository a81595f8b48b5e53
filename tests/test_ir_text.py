"""The step IR's text form: exact round trip, print-time names, clear parse and verify errors."""
import pytest

from kestrel.compiler.frontend import parse_config
from kestrel.compiler.ir import IRError, Program
from kestrel.compiler.ops import emit, verify
from kestrel.passes import plan_memory
from kestrel.compiler.ir_text import parse_program, print_program
from kestrel.compiler.presets import PRESETS
from kestrel.compiler.qwen3_5 import lower


def tiny_program() -> Program:
    prog = lower(parse_config(PRESETS["tiny"]), max_seq=32)
    return prog


def compiled_program(target="sm_90", quant="q4") -> Program:
    from kestrel.passes.pipeline import PassOptions, run_passes

    return run_passes(tiny_program(), PassOptions(target, quant))


def test_round_trip_is_exact():
    text = print_program(tiny_program())
    again = print_program(parse_program(text))
    assert again == text
    # every op kind of the model appears, with attributes of every type (float, int, str, list)
    for needle in ("= gated_delta_step", "{scale=", "{act=\"silu\"}", "{shape=[", "kv_append ", "dyn.sampled = sample",
                   "dyn pos:i32 host", '<- ["reshape",[256,4],["ckpt","layers.0.linear_attn.conv1d.weight"]]', "output logits %"):
        assert needle in text


def test_round_trip_after_all_passes():
    text = print_program(compiled_program())
    assert print_program(parse_program(text)) == text
    for needle in ("target sm_90", "arena weights=", "dyn pos:i32 @dyn+0", "q4g128[", '<- ["q4",128,', " @act+",
                   "dyn.pos, dyn.token = step_end", 'launch{kernel="gdn_delta", grid=[4,4,1], num_warps=1, HK=2, HV=4, DK=32',
                   'launch{kernel="gdn_norm", grid=[4,1,1], num_warps=4, HV=4, DV=32'):
        assert needle in text


def test_floats_survive_exactly():
    prog = tiny_program()
    back = parse_program(print_program(prog))
    a = [op.attrs for op in prog.ops]
    b = [op.attrs for op in back.ops]
    assert a == b


def test_names_are_assigned_at_print_time():
    prog = tiny_program()
    before = print_program(prog).splitlines()
    # values store no names: numbering is by definition order at print time, so an op appended
    # at the end leaves every earlier line unchanged
    assert not hasattr(prog.outputs["hidden"], "name")
    x = prog.outputs["hidden"]
    emit(prog, "add", x, x)
    after = print_program(prog).splitlines()
    ops_before = [l for l in before if not l.startswith("output")]
    assert after[:len(ops_before)] == ops_before


def test_comments_and_blank_lines_are_ignored():
    text = print_program(tiny_program())
    noisy = "# a comment\n\n" + text.replace("\nweight ", "\n# weights follow\nweight ", 1)
    assert print_program(parse_program(noisy)) == text


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.replace("kestrel.step v1", "kestrel.step v9"), "missing header"),
    (lambda t: t.replace("= embedding", "= embeding"), "unknown op 'embeding'"),
    (lambda t: t.replace("f32[128] = embedding", "f32[129] = embedding"), "shape rule gives"),
    (lambda t: t.replace("rmsnorm %0, layers.0.input_layernorm", "rmsnorm %1, layers.0.input_layernorm", 1),
     "used before it is defined"),
    (lambda t: t.replace("dyn.token\n", "dyn.tokn\n", 1), "dyn slot 'tokn' is not declared"),
    (lambda t: t.replace("{eps=1e-06}", "", 1), "attributes missing ['eps']"),
    (lambda t: t.replace("matmul %1, layers.0.linear_attn.in_proj_qkv", "matmul %1, nowhere", 1),
     "unknown operand 'nowhere'"),
])
def test_parse_errors_name_the_problem(mutate, message):
    text = print_program(tiny_program())
    bad = mutate(text)
    assert bad != text
    with pytest.raises(IRError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_program(bad)


def test_verify_rejects_mismatched_matmul():
    p = Program()
    tok = p.add_dyn("token", "i32")
    e = p.add_weight("e", "f32", (10, 8))
    w = p.add_weight("w", "f32", (4, 7))
    x = emit(p, "embedding", e, tok)
    with pytest.raises(IRError, match="matmul"):
        emit(p, "matmul", x, w)
    verify(p)


def test_verify_catches_overlapping_live_activations():
    import os

    path = os.path.join(os.path.dirname(__file__), "golden", "plan_memory", "liveness_chain.out.ir")
    text = open(path).read()
    plan_memory.check(parse_program(text))  # the planned program is hazard-free ...
    bad = text.replace("%3 : f32[64] @act+256", "%3 : f32[64] @act+512")  # ... put %3 over the live %2
    with pytest.raises(IRError, match="overlap in the arena"):
        plan_memory.check(parse_program(bad))
    with pytest.raises(IRError, match="unaligned"):
        plan_memory.check(parse_program(text.replace("%3 : f32[64] @act+256", "%3 : f32[64] @act+260")))
