"""Compiling streams the checkpoint: peak anonymous memory must not grow with the checkpoint's size.

Two synthetic bf16 checkpoints differing only in layer count (~20 MB vs ~135 MB) are compiled to fp32
plans in fresh processes (so every tensor is converted into new private memory); a sampler thread reads RssAnon (private memory, excluding the file pages that
mmap'd reads leave resident) every few ms. The larger build may not use more than a small fraction
of the extra bytes.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from kestrel.compiler.frontend import expected_tensors, parse_config
from kestrel.compiler.presets import PRESETS

PROBE = r"""
import re, sys, threading, time
peak = [0]
def sample():
    while True:
        m = re.search(r"RssAnon:\s+(\d+) kB", open("/proc/self/status").read())
        peak[0] = max(peak[0], int(m.group(1)) * 1024)
        time.sleep(0.002)
import torch, safetensors, tokenizers  # imported before the baseline
threading.Thread(target=sample, daemon=True).start()
time.sleep(0.05)
base = peak[0]
from kestrel.compiler.build import build
build(sys.argv[1], sys.argv[2], max_seq=16, log=lambda m: None, progress=False)
time.sleep(0.05)
print(peak[0] - base)
"""


def make_checkpoint(folder, n_layers):
    raw = dict(PRESETS["tiny"], hidden_size=512, intermediate_size=2048, vocab_size=1024,
               num_hidden_layers=n_layers, layer_types=None, linear_num_key_heads=4, linear_num_value_heads=8,
               linear_key_head_dim=64, linear_value_head_dim=64, num_attention_heads=8, num_key_value_heads=2,
               head_dim=64)
    raw.pop("layer_types")
    cfg = parse_config(raw)
    gen = torch.Generator().manual_seed(0)
    os.makedirs(folder)
    shapes = dict(expected_tensors(cfg), **{"lm_head.weight": (cfg.vocab_size, cfg.hidden_size)})
    tensors = {("" if n == "lm_head.weight" else "model.") + n: torch.randn(s, generator=gen).to(torch.bfloat16)
               for n, s in shapes.items()}
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    json.dump(raw, open(os.path.join(folder, "config.json"), "w"))
    return sum(t.numel() * 4 for t in tensors.values())  # bytes once converted to fp32


def peak_extra(ckpt, out):
    r = subprocess.run([sys.executable, "-c", PROBE, ckpt, out], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fp8", [False, True])
def test_peak_memory_does_not_grow_with_checkpoint(tmp_path, fp8):
    """fp8: both checkpoints as FP8 releases (each e4m3 matrix dequantized to fp32 as it is read)."""
    small = make_checkpoint(str(tmp_path / "small"), 2)
    large = make_checkpoint(str(tmp_path / "large"), 16)
    if fp8:
        from hf_checkpoints import make_fp8_release

        for folder in ("small", "large"):
            assert len(make_fp8_release(str(tmp_path / folder), block=(128, 128))) > 8
    assert large - small > 150e6
    m_small = peak_extra(str(tmp_path / "small"), str(tmp_path / "s.plan"))
    m_large = peak_extra(str(tmp_path / "large"), str(tmp_path / "l.plan"))
    print(f"weights {small / 1e6:.0f} MB -> peak +{m_small / 1e6:.0f} MB; {large / 1e6:.0f} MB -> +{m_large / 1e6:.0f} MB")
    assert m_large - m_small < 0.15 * (large - small)
