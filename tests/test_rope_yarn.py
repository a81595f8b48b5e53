"""YaRN RoPE (``rope_type: yarn``, Qwen's recipe past the native context): the frontend's parameters against
transformers' own, the configs it refuses, the position limit YaRN extends, the IR's ``yarn`` option (text form,
verify, launch constexpr, not a kernel scalar) and the ONNX step with it. The kernels: test_kernels_attention.py /
test_kernels_attn_rows.py (interpreter); a plan's launch list: test_launch_plan_interpreted.py; against
transformers' generate: test_oracle.py ("yarn") and test_oracle_next.py ("e8k2_yarn")."""
import json

import numpy as np
import pytest
import torch

from kestrel.artifacts.errors import ConfigError, InputError
from kestrel.compiler.build import open_model, resolve_max_seq, step_program
from kestrel.compiler.frontend import ModelConfig, parse_config
from kestrel.compiler.ir import IRError
from kestrel.compiler.ir_text import parse_program, print_program
from kestrel.compiler.ops import scalar_attrs, verify
from kestrel.compiler.qwen3_5 import lower
from kestrel.kernels.attention import rope_inv_freq
from kestrel.passes.pipeline import PassOptions, run_passes

QWEN3_NEXT = {"factor": 4.0, "original_max_position_embeddings": 262144}  # Qwen3-Next's model card
CASES = [QWEN3_NEXT, dict(factor=2.0, original_max_position_embeddings=4096, beta_fast=16, beta_slow=2),
         dict(factor=8.0, original_max_position_embeddings=2048, truncate=False),
         dict(factor=3.0, original_max_position_embeddings=1000, attention_factor=1.5),
         dict(factor=4.0, original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=0.5),
         dict(factor=None, original_max_position_embeddings=65536)]


def _transformers_yarn(config):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS["yarn"](config)


@pytest.mark.parametrize("rope", CASES, ids=lambda r: ",".join(f"{k}={v}" for k, v in r.items()))
@pytest.mark.parametrize("model", ["qwen3_next", "qwen3_5_text"])
def test_parameters_are_transformers(model, rope):
    """parse_config's YaRN settings give transformers' ``_compute_yarn_parameters`` inverse frequencies bit for bit
    and its attention factor exactly, at the published 80B-A3B head (256 wide, a quarter rotated, theta 1e7) and
    at two others; the positions reach factor x original_max_position_embeddings."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    for head_dim, prf, theta in ((256, 0.25, 1e7), (64, 0.5, 1e4), (128, 1.0, 5e5)):
        cls = Qwen3NextConfig if model == "qwen3_next" else Qwen3_5TextConfig
        config = cls(head_dim=head_dim, max_position_embeddings=262144,
                     rope_parameters={"rope_type": "yarn", "rope_theta": theta, "partial_rotary_factor": prf, **rope})
        inv, attention_factor = _transformers_yarn(config)
        cfg = parse_config(config.to_dict())
        assert torch.equal(rope_inv_freq(cfg.rope_theta, cfg.rotary_dim, cfg.rope_yarn), inv), (head_dim, prf)
        assert cfg.rope_yarn[3] == attention_factor
        assert cfg.max_positions == int((rope["factor"] or 262144 / 65536) * rope["original_max_position_embeddings"])
        assert not torch.equal(inv, rope_inv_freq(theta, cfg.rotary_dim)), "a case YaRN leaves unchanged"


def _raw(**over) -> dict:
    """A Qwen3-Next config.json as a release writes it (transformers' defaults, the 80B-A3B head)."""
    from transformers import Qwen3NextConfig

    raw = Qwen3NextConfig(head_dim=256, max_position_embeddings=262144,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                           "partial_rotary_factor": 0.25}).to_dict()
    return raw | over


def test_the_older_layouts_give_the_same_parameters():
    """``rope_scaling`` with ``rope_theta`` at the top level (the released config.json files; ``type`` for
    ``rope_type``), and original_max_position_embeddings at the top level (as Phi-3 keeps it), parse as
    ``rope_parameters`` does."""
    want = parse_config(_raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                              **QWEN3_NEXT}))
    old = _raw(rope_theta=1e7, partial_rotary_factor=0.25, rope_scaling={"type": "yarn", "factor": 4.0,
                                                                           "original_max_position_embeddings": 262144})
    del old["rope_parameters"]
    top = _raw(original_max_position_embeddings=262144,
               rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "factor": 4.0})
    for raw in (old, top):
        got = parse_config(raw)
        assert got.rope_yarn == want.rope_yarn and got.max_positions == want.max_positions == 1048576
        assert got.rope_yarn[1:3] == (14.0, 8.0)  # the ramp over frequency indices 14 .. 22 of the 32


@pytest.mark.parametrize("rope,msg", [
    ({"rope_type": "linear", "factor": 2.0}, "rope_type 'linear' is not supported (expected 'default' or 'yarn')"),
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic' is not supported"),
    ({"rope_type": "longrope"}, "rope_type 'longrope' is not supported"),
    ({"rope_type": "yarn", "factor": 0.5}, "YaRN's factor must be at least 1, got 0.5"),
    ({"rope_type": "yarn", "factor": "4"}, "'factor' must be a number, got '4'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1.5e5},
     "YaRN's original_max_position_embeddings must be a positive integer, got 150000.0"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}, "YaRN's truncate must be true or false"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, "'beta_fast' must be positive"),
    ({"rope_type": "yarn", "factor": 4.0, "rope_theta": 1.0}, "YaRN needs rope_theta > 1"),
])
def test_unsupported_rope_settings_are_refused_in_one_line(rope, msg):
    raw = _raw(rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.25, **rope})
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")) as e:
        parse_config(raw)
    assert "\n" not in str(e.value) and e.value.exit_code == 3


def test_plain_rope_configs_are_as_before_and_yarn_round_trips():
    """A plain-RoPE model's normalised config (the plan's manifest "model") has no YaRN keys, so plans of such
    models are what they were; a YaRN one's comes back whole from its JSON."""
    plain = parse_config(_raw())
    assert not {"rope_yarn", "rope_max_positions"} & set(plain.to_json()) and plain.max_positions == 262144
    yarn = parse_config(_raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                              **QWEN3_NEXT}))
    assert ModelConfig.from_json(json.loads(json.dumps(yarn.to_json()))) == yarn
    assert ModelConfig.from_json(json.loads(json.dumps(plain.to_json()))) == plain


def test_max_seq_reaches_yarns_positions():
    """--max-seq may go to factor x original_max_position_embeddings (Qwen3-Next's 1,048,576), not past it; the KV
    cache's 32-bit offsets bound it too (80B-A3B: 2 kv heads of 256, 4,194,303 rows)."""
    cfg = parse_config(_raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                             **QWEN3_NEXT}))
    assert resolve_max_seq(cfg, 1048576) == 1048576 and resolve_max_seq(cfg, None) == 4096
    with pytest.raises(InputError, match=r"positions with YaRN \(1048576: factor x original"):
        resolve_max_seq(cfg, 1048577)
    with pytest.raises(InputError, match="max_position_embeddings \\(262144\\)"):
        resolve_max_seq(parse_config(_raw()), 262145)
    wide = parse_config(_raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                              "factor": 32.0, "original_max_position_embeddings": 262144}))
    assert resolve_max_seq(wide, 4194303) == 4194303
    with pytest.raises(InputError, match="32-bit offsets allow at most 4194303 rows"):
        resolve_max_seq(wide, 4194304)


MINI = dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            layer_types=["linear_attention", "full_attention"], num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False, rms_norm_eps=1e-6,
            max_position_embeddings=128,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "factor": 4.0,
                             "original_max_position_embeddings": 4096, "truncate": False})


def test_the_ir_carries_yarn_as_an_option():
    """The rope ops, and after fuse attn_step, carry ``yarn`` as an option (absent on a plain-RoPE model's ops);
    the text form prints and parses it back; verify refuses it on an op without the option; select_kernels
    gives attn_step the ``YARN`` constexpr, and the kernel's scalars stay eps, theta, rotary_dim, scale."""
    cfg = parse_config(MINI)
    program = lower(cfg, 16)
    ropes = [op for op in program.ops if op.kind == "rope"]
    assert len(ropes) == 2 and all(op.attrs["yarn"] == list(cfg.rope_yarn) for op in ropes)
    text = print_program(program)
    assert "yarn=[4.0,1.3" in text and print_program(parse_program(text)) == text
    bad = next(op for op in program.ops if op.kind == "rmsnorm")
    bad.attrs["yarn"] = list(cfg.rope_yarn)
    with pytest.raises(IRError, match=r"attributes missing \[\] / unexpected \['yarn'\]"):
        verify(program)
    del bad.attrs["yarn"]
    ropes[0].attrs["yarn"] = [4.0, 1.0, 0.0, 1.1]
    with pytest.raises(IRError, match=r"yarn must be \[factor >= 1, ramp low, ramp span > 0, attention factor\]"):
        verify(program)
    ropes[0].attrs["yarn"] = list(cfg.rope_yarn)
    gpu = run_passes(program, PassOptions("sm_90", "bf16", 32))
    (attn,) = [op for op in gpu.ops if op.kind == "attn_step"]
    assert attn.attrs["yarn"] == list(cfg.rope_yarn) and attn.launch["YARN"] == list(cfg.rope_yarn)
    assert scalar_attrs(attn) == [attn.attrs[k] for k in ("eps", "theta", "rotary_dim", "scale")]
    assert print_program(parse_program(print_program(gpu))) == print_program(gpu)
    plain = lower(parse_config(dict(MINI, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                           "partial_rotary_factor": 0.5})), 16)
    assert not any("yarn" in op.attrs for op in plain.ops)


def test_onnx_step_with_yarn_matches_cpu_reference(tmp_path):
    """The ONNX step of a YaRN model (its frequency table and cos / sin scaled by the attention factor) in
    onnxruntime against the CPU path: the same greedy tokens, logits within 1e-4 (test_onnx.py's bar)."""
    from kestrel.compiler.onnx_export import export_program
    from kestrel.compiler.weights import weight_bytes
    from test_launch_plan_interpreted import _write_checkpoint
    from test_onnx import TOL, cpu_decode, ort_decode, session

    with open_model(_write_checkpoint(str(tmp_path), MINI, 3), 32) as m:
        prog = step_program(m.cfg, 32)
        raw = {n: bytes(weight_bytes(w, m.ck.read)) for n, w in prog.weights.items()}
    model, sig = export_program(prog, lambda n: raw[n])
    prompt = [5, 9, 3, 60, 17]
    got, want = ort_decode(session(model), sig, prompt, 12), cpu_decode(prog, raw, prompt, 12)
    assert [t for t, _ in got] == [t for t, _ in want]
    worst = max(float(np.abs(a - b).max() / np.abs(b).max()) for (_, a), (_, b) in zip(got, want))
    assert worst <= TOL, worst
