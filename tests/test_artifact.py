"""The .plan container: round trip, readable by safetensors, and every corruption caught clearly."""
import hashlib
import json
import os
import shutil
import struct

import numpy as np
import pytest
from safetensors import safe_open

from conftest import run_cli
from kestrel.artifacts.errors import ArtifactError
from kestrel.artifacts.plan import FORMAT_VERSION, PROGRAM_PART, load_plan
from kestrel.compiler.ir_text import parse_program


def test_round_trip(tiny_plan):
    plan = load_plan(tiny_plan)
    prog = parse_program(plan.program_text)
    assert set(plan.weight_names) == set(prog.weights)
    assert plan.manifest["format_version"] == FORMAT_VERSION
    assert plan.manifest["target"] == "cpu" and plan.manifest["max_seq"] == 256
    assert plan.tokenizer_json and "<|endoftext|>" in plan.tokenizer_json
    assert plan.verify_all() > prog.weight_bytes()
    plan.close()


def test_plan_is_a_safetensors_file(tiny_plan):
    plan = load_plan(tiny_plan)
    with safe_open(tiny_plan, framework="np") as f:
        assert set(f.keys()) == set(plan.manifest["parts"])
        w = f.get_tensor("layers.0.mlp.up_proj")
        mine = np.frombuffer(plan.read("layers.0.mlp.up_proj"), dtype=np.float32).reshape(w.shape)
        assert np.array_equal(w, mine)
        assert "kestrel.manifest" in f.metadata()
    plan.close()


def test_build_is_reproducible(tiny_plan, tmp_path):
    from kestrel.compiler.build import build

    other = str(tmp_path / "again.plan")
    build("tiny", other, max_seq=256, log=lambda m: None, progress=False)
    assert open(other, "rb").read() == open(tiny_plan, "rb").read()


def _copy(tiny_plan, tmp_path, name="bad.plan"):
    path = str(tmp_path / name)
    shutil.copy(tiny_plan, path)
    return path


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return n, json.loads(f.read(n))


def _rewrite_manifest(path, edit, fix_checksum=True):
    n, header = _header(path)
    m = json.loads(header["__metadata__"]["kestrel.manifest"])
    edit(m)
    text = json.dumps(m, sort_keys=True)
    header["__metadata__"]["kestrel.manifest"] = text
    if fix_checksum:
        header["__metadata__"]["kestrel.manifest_sha256"] = hashlib.sha256(text.encode()).hexdigest()
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(raw + b" " * (n - len(raw)))


def test_truncated(tiny_plan, tmp_path):
    path = _copy(tiny_plan, tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    with pytest.raises(ArtifactError, match="truncated"):
        load_plan(path)


def test_altered_weight_byte(tiny_plan, tmp_path):
    path = _copy(tiny_plan, tmp_path)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 5)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    plan = load_plan(path)  # header and program are intact ...
    with pytest.raises(ArtifactError, match="fails its checksum"):  # ... the damaged weight is not
        plan.verify_all()
    r = run_cli("kestrelc", "inspect", path, "--verify")
    assert r.returncode == ArtifactError.exit_code and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "fails its checksum" in r.stderr
    r = run_cli("kestrel-run", path, "--prompt", "hi", "--max-new-tokens", "2")
    assert r.returncode == ArtifactError.exit_code and "fails its checksum" in r.stderr


def test_altered_program(tiny_plan, tmp_path):
    path = _copy(tiny_plan, tmp_path)
    plan = load_plan(path)
    _, _, lo, _ = plan.container.tensors[PROGRAM_PART]
    start = plan.container.data_start + lo
    plan.close()
    with open(path, "r+b") as f:
        f.seek(start + 20)
        f.write(b"#")
    with pytest.raises(ArtifactError, match="'__kestrel__/program' fails its checksum"):
        load_plan(path)


def test_edited_manifest(tiny_plan, tmp_path):
    path = _copy(tiny_plan, tmp_path)
    _rewrite_manifest(path, lambda m: m.update(max_seq=255), fix_checksum=False)
    with pytest.raises(ArtifactError, match="manifest was altered"):
        load_plan(path)


def test_other_format_version(tiny_plan, tmp_path):
    path = _copy(tiny_plan, tmp_path)
    _rewrite_manifest(path, lambda m: m.update(format_version=FORMAT_VERSION + 1))
    with pytest.raises(ArtifactError, match=f"format version {FORMAT_VERSION + 1}.*rebuild"):
        load_plan(path)
    r = run_cli("kestrel-run", path, "--prompt", "hi")
    assert r.returncode == ArtifactError.exit_code
    assert r.stderr.startswith("error: ") and "format version" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("content, message", [
    (b"", "not a Kestrel plan"),
    (b"hello world, certainly not a plan", "not a Kestrel plan"),
    (struct.pack("<Q", 10) + b"{not json}", "not a Kestrel plan"),
])
def test_not_a_plan(tmp_path, content, message):
    path = tmp_path / "x.plan"
    path.write_bytes(content)
    with pytest.raises(ArtifactError, match=message):
        load_plan(str(path))


def test_plain_safetensors_is_not_a_plan(tmp_path):
    from safetensors.numpy import save_file

    path = str(tmp_path / "w.safetensors")
    save_file({"a": np.zeros(3, np.float32)}, path)
    with pytest.raises(ArtifactError, match="not a Kestrel plan"):
        load_plan(path)


def test_missing_file(tmp_path):
    r = run_cli("kestrel-run", str(tmp_path / "nope.plan"), "--prompt", "hi")
    assert r.returncode == ArtifactError.exit_code and "cannot open" in r.stderr
