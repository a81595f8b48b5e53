"""The published Qwen3.5 shapes as presets: each builds with --weights random (a seed, no weights),
is marked random in inspect, and has the parameter count its name says (text model only)."""
import json

import pytest

from conftest import run_cli
from kestrel.compiler.frontend import parse_config
from kestrel.compiler.presets import QWEN35_SHAPES
from kestrel.compiler.qwen3_5 import lower

# billions of text-model parameters (the published sizes include the vision tower)
EXPECTED_B = {"qwen3.5-0.8b": (0.70, 0.80), "qwen3.5-2b": (1.8, 2.0), "qwen3.5-4b": (4.0, 4.4),
              "qwen3.5-9b": (8.7, 9.2), "qwen3.5-27b": (26.5, 27.5)}


def test_every_published_size_is_a_preset():
    assert sorted(QWEN35_SHAPES) == sorted(EXPECTED_B)


@pytest.mark.parametrize("name", sorted(EXPECTED_B))
def test_parameter_count(name):
    cfg = parse_config(QWEN35_SHAPES[name], name)
    n = sum(w.type.numel for w in lower(cfg, 16).weights.values()) / 1e9
    lo, hi = EXPECTED_B[name]
    assert lo <= n <= hi, f"{name}: {n:.3f}B parameters"
    assert cfg.layer_types.count("full_attention") * 4 == len(cfg.layer_types)


@pytest.mark.parametrize("name", ["qwen3.5-2b", "qwen3.5-9b"])
def test_random_weights_build_records_a_seed(name, tmp_path):
    path = str(tmp_path / f"{name}.plan")
    r = run_cli("kestrelc", "build", name, "--weights", "random", "--seed", "5", "-o", path)
    assert r.returncode == 0, r.stderr
    assert "--weights random" in r.stderr
    info = json.loads(run_cli("kestrelc", "inspect", path, "--json").stdout)
    assert info["weights"] == {"kind": "random", "seed": 5, "q4_scales": True}  # (q4 scales: kernels/fill.py)
    assert info["bytes"] < 1 << 20 < info["program"]["weight_bytes"]  # a seed, not gigabytes of weights


@pytest.mark.parametrize("name, total, active", [("qwen3.5-35b-a3b", (34.0, 35.5), (2.7, 3.2)),
                                                 ("qwen3-next-80b-a3b", (79.0, 80.5), (3.0, 3.8))])
def test_moe_parameter_counts(name, total, active):
    """The MoE shapes' parameters as their names say: all of them, and those one token reads (the routed experts'
    top-k share, the embedding table's one row not counted)."""
    from kestrel.compiler.presets import SHAPES

    cfg = parse_config(SHAPES[name], name)
    n = sum(w.type.numel for w in lower(cfg, 16).weights.values())
    experts = cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    read = n - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts) - cfg.vocab_size * cfg.hidden_size
    assert total[0] <= n / 1e9 <= total[1] and active[0] <= read / 1e9 <= active[1], (n, read)
    assert set(cfg.mlp_types) == {"moe"} and cfg.layer_types.count("full_attention") * 4 == len(cfg.layer_types)
