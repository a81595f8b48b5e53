"""Regenerate the golden *input* files: `python tests/golden/make_inputs.py`.

Each pass's inputs are small programs as they reach that pass (the lowering's output run through the
passes before it), so each golden pair shows exactly one pass's effect. Expected .out.ir / .diff files
are written by the test runner with KESTREL_UPDATE_GOLDEN=1 (review every diff before committing);
.checks files are written by hand (see tests/test_golden.py).
"""
from __future__ import annotations

import json
import os

from kestrel.compiler.frontend import parse_config
from kestrel.compiler.ir_text import parse_program, print_program
from kestrel.passes.pipeline import PASS_NAMES, PassOptions, run_passes
from kestrel.compiler.qwen3_5 import lower, lower_speculative

HERE = os.path.dirname(os.path.abspath(__file__))

BASE = dict(model_type="qwen3_5_text", vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
            linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=64)

MODELS = {
    "gdn_layer": dict(layer_types=["linear_attention"]),
    "attn_layer_gqa2": dict(layer_types=["full_attention"]),
    "attn_layer_mha": dict(layer_types=["full_attention"], num_key_value_heads=2),
    "attn_layer_gqa4": dict(layer_types=["full_attention"], num_attention_heads=4),
    "tied_two_layers": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                            tie_word_embeddings=True),
    "hidden48": dict(hidden_size=48, layer_types=["linear_attention"]),
    "attn_layer_gqa2_long": dict(layer_types=["full_attention"], max_position_embeddings=1024),
    # every matrix q4 (inputs multiples of 32): the tensor-core q4 kernel's shapes at M rows
    "q4_two_layers": dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], hidden_size=64,
                          intermediate_size=128, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32),
}
MAX_SEQ = {"attn_layer_gqa2_long": 1024}  # others: 8
ROWS = {"tied_two_layers_rows4": ("tied_two_layers", 4), "q4_two_layers_rows4": ("q4_two_layers", 4),
        "q4_two_layers_rows32": ("q4_two_layers", 32), "attn_layer_gqa2_long_rows4": ("attn_layer_gqa2_long", 4)}  # the M-row step of a model: (model, M)
SPEC = {"tied_two_layers_spec_k1": ("tied_two_layers", 1),
        "q4_two_layers_spec_k3": ("q4_two_layers", 3)}  # the speculative iteration of a model: (model, K)

# Hand-written programs (also exercise the parser).
NOTHING_TO_FUSE = """kestrel.step v1
dyn pos:i32 host
dyn token:i32 host
dyn sampled:i32 host
dyn temperature:f32 host
dyn top_p:f32 host
dyn seed:i32 host
dyn n_prompt:i32 host
dyn top_k:i32 host
dyn min_p:f32 host
weight embed_tokens : f32[16,32] <- ["ckpt","embed_tokens.weight"]
weight lm_head : f32[16,32] <- ["ckpt","lm_head.weight"]
state tokens : i32[8]
state scratch.sample_partials : f32[1,1]
state scratch.sample_ticket : i32[1]
%0 : f32[32] = embedding embed_tokens, dyn.token
%1 : f32[16] = matmul %0, lm_head
dyn.sampled = sample %1, dyn.temperature, dyn.top_p, dyn.top_k, dyn.min_p, dyn.seed, dyn.pos, scratch.sample_partials, scratch.sample_ticket
output hidden %0
output logits %1
"""

LIVENESS_CHAIN = """kestrel.step v1
dyn pos:i32
dyn token:i32
dyn sampled:i32
dyn temperature:f32
dyn top_p:f32
dyn seed:i32
dyn n_prompt:i32
dyn top_k:i32
dyn min_p:f32
weight embed_tokens : f32[16,32] <- ["ckpt","embed_tokens.weight"]
weight w1 : f32[64,32] <- ["ckpt","w1"]
weight w2 : f32[32,64] <- ["ckpt","w2"]
weight w3 : f32[64,32] <- ["ckpt","w3"]
weight w4 : f32[32,64] <- ["ckpt","w4"]
weight norm : f32[32] <- ["ckpt","norm"]
weight lm_head : f32[16,32] <- ["ckpt","lm_head.weight"]
state tokens : i32[8]
state scratch.sample_partials : f32[1,1]
state scratch.sample_ticket : i32[1]
%0 : f32[32] = embedding embed_tokens, dyn.token
%1 : f32[64] = matmul %0, w1
%2 : f32[32] = matmul %1, w2
%3 : f32[64] = matmul %2, w3
%4 : f32[32] = matmul %3, w4
%5 : f32[32], %6 : f32[32] = add_rmsnorm %0, %4, norm {eps=1e-06}
%7 : f32[16] = matmul %6, lm_head
dyn.sampled = sample %7, dyn.temperature, dyn.top_p, dyn.top_k, dyn.min_p, dyn.seed, dyn.pos, scratch.sample_partials, scratch.sample_ticket
dyn.pos, dyn.token = step_end dyn.pos, dyn.sampled, dyn.n_prompt, tokens
output hidden %6
output logits %7
"""

# pass -> [(case, model or hand-written text, passes' options)]
CASES = {
    "fuse": [("gdn_layer", "gdn_layer", {}), ("attn_layer_gqa2", "attn_layer_gqa2", {}),
             ("rows4_tied_two_layers", "tied_two_layers_rows4", {}),
             ("attn_layer_gqa4", "attn_layer_gqa4", {}), ("tied_two_layers", "tied_two_layers", {}),
             ("nothing_to_fuse", NOTHING_TO_FUSE, {}), ("spec_k1_tied_two_layers", "tied_two_layers_spec_k1", {})],
    "quantize": [("bf16_gdn_layer", "gdn_layer", {"quant": "bf16"}),
                 ("q4_g64_attn_layer", "attn_layer_mha", {"quant": "q4", "q4_group": 64}),
                 ("q4_tied_lm_head_copy", "tied_two_layers", {"quant": "q4"}),
                 ("q4_group_fallback_hidden48", "hidden48", {"quant": "q4"}),
                 ("none_is_identity", "gdn_layer", {"quant": "none"})],
    "fold_row_norms": [("q4_sm90_rows4", "q4_two_layers_rows4", {"quant": "q4", "target": "sm_90"}),
                       ("q4_sm90_spec_k3", "q4_two_layers_spec_k3", {"quant": "q4", "target": "sm_90"}),
                       ("bf16_sm90_rows4", "q4_two_layers_rows4", {"quant": "bf16", "target": "sm_90"}),
                       ("q4_sm90_rows32_gemm", "q4_two_layers_rows32", {"quant": "q4", "target": "sm_90"}),
                       ("q4_cpu_rows4", "q4_two_layers_rows4", {"quant": "q4", "target": "cpu"})],
    "hoist_dynamic": [("gdn_layer", "gdn_layer", {"quant": "bf16"}), ("attn_layer_gqa2", "attn_layer_gqa2", {}),
                      ("nothing_to_fuse", NOTHING_TO_FUSE, {}), ("already_hoisted", LIVENESS_CHAIN, {})],
    "plan_memory": [("gdn_layer", "gdn_layer", {"quant": "bf16"}), ("attn_layer_gqa4", "attn_layer_gqa4", {}),
                    ("liveness_chain", LIVENESS_CHAIN, {}), ("tied_two_layers_q4", "tied_two_layers", {"quant": "q4"})],
    "select_kernels": [("sm_90_bf16_tied", "tied_two_layers", {"quant": "bf16", "target": "sm_90"}),
                       ("sm_80_q4_gdn", "gdn_layer", {"quant": "q4", "target": "sm_80"}),
                       ("sm_120_attn_mha", "attn_layer_mha", {"quant": "bf16", "target": "sm_120"}),
                       ("sm_90_attn_splits", "attn_layer_gqa2_long", {"quant": "bf16", "target": "sm_90"}),
                       ("sm_90_attn_rows_splits", "attn_layer_gqa2_long_rows4", {"quant": "bf16", "target": "sm_90"}),
                       ("cpu_liveness_chain", LIVENESS_CHAIN, {"target": "cpu"})],
}


def program_for(model: str):
    if model.startswith("kestrel.step"):
        return parse_program(model)
    if model in SPEC:
        model, k = SPEC[model]
        return lower_speculative(parse_config(dict(BASE, **MODELS[model])), max_seq=MAX_SEQ.get(model, 8),
                                 draft_tokens=k)
    model, rows = ROWS.get(model, (model, 0))
    return lower(parse_config(dict(BASE, **MODELS[model])), max_seq=MAX_SEQ.get(model, 8), rows=rows)


def main():
    for pass_name, cases in CASES.items():
        folder = os.path.join(HERE, pass_name)
        os.makedirs(folder, exist_ok=True)
        before = PASS_NAMES[PASS_NAMES.index(pass_name) - 1] if pass_name != PASS_NAMES[0] else None
        for case, model, opts in cases:
            prog = program_for(model)
            if before is not None:
                prog = run_passes(prog, PassOptions(**opts), until=before)
            with open(os.path.join(folder, f"{case}.in.ir"), "w") as f:
                f.write(f"# pass-options: {json.dumps(opts, sort_keys=True)}\n")
                f.write(print_program(prog))
            print(f"wrote {pass_name}/{case}.in.ir")


if __name__ == "__main__":
    main()
