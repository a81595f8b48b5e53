"""Imports follow the flow (README, "Architecture"): every module of the five packages is read with
``ast`` and each import checked against the layer table below. A module imports only from its own
layer and the layers it is allowed to see; imports sit at the top of the file except optional
dependencies (onnx, onnxruntime, tensorrt, cuda) and the runtime's CPU reference path (torch); the
GPU runtime imports neither torch nor Triton."""
import ast
import os

import pytest

from conftest import REPO

PACKAGES = {"artifacts": "kestrel.artifacts", "kernels": "kestrel.kernels", "compiler": "kestrel.compiler",
            "passes": "kestrel.passes", "runtime": "kestrel.runtime"}
IR_CORE = ("kestrel.compiler.ir", "kestrel.compiler.ops", "kestrel.compiler.ir_text", "kestrel.compiler.launch_plan")
# layer -> the layers its modules may import (their own included)
ALLOWED = {
    "artifacts": {"artifacts"},
    "kernels": {"kernels"},
    "ir core": {"artifacts", "kernels", "ir core"},
    "passes": {"artifacts", "kernels", "ir core", "passes"},
    "compiler": {"artifacts", "kernels", "ir core", "passes", "compiler"},
    "cpu reference": {"artifacts", "kernels", "ir core", "runtime"},
    "runtime": {"artifacts", "runtime", "cpu reference"},  # the CPU path only late, where it runs (torch)
}
LAZY_OK = ("onnx", "onnxruntime", "tensorrt", "cuda", "kestrel.runtime.cpu")
GPU_FORBIDDEN = ("torch", "triton")


def layer_of(module: str) -> str:
    if module in IR_CORE:
        return "ir core"
    if module == "kestrel.runtime.cpu":
        return "cpu reference"
    return module.split(".")[1]


def modules() -> dict[str, str]:
    """kestrel module name -> source path."""
    out = {}
    for folder, package in PACKAGES.items():
        for f in sorted(os.listdir(os.path.join(REPO, folder))):
            if f.endswith(".py"):
                name = package if f == "__init__.py" else f"{package}.{f[:-3]}"
                out[name] = os.path.join(REPO, folder, f)
    return out


def imports(source: str, known: set[str]) -> list[tuple[str, bool, int]]:
    """(module imported, at the top level?, line) for every import in ``source``."""
    tree = ast.parse(source)
    top = {id(n) for n in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known]
            found += [(m, id(node) in top, node.lineno) for m in subs or [node.module]]
    return [f for f in found if f[0] != "__future__"]


def violations(name: str, source: str, known: set[str]) -> list[str]:
    out, layer = [], layer_of(name)
    for mod, at_top, line in imports(source, known):
        where = f"{name}:{line} imports {mod}"
        if not at_top and not mod.startswith(LAZY_OK):
            out.append(f"{where} inside a function (only optional dependencies may be imported late)")
        if mod.startswith("kestrel."):
            if layer_of(mod) not in ALLOWED[layer]:
                out.append(f"{where}: layer {layer!r} may not import layer {layer_of(mod)!r}")
        elif layer == "runtime" and mod.split(".")[0] in GPU_FORBIDDEN:
            out.append(f"{where}: the GPU runtime imports no torch or Triton")
        if layer == "runtime" and mod == "kestrel.runtime.cpu" and at_top:
            out.append(f"{where} at the top: the CPU reference path (torch) is imported only where it runs")
    return out


def test_imports_follow_the_layers():
    mods = modules()
    problems = [v for name, path in mods.items() for v in violations(name, open(path).read(), set(mods))]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name, source, expect", [
    ("kestrel.runtime.gpu", "from kestrel.compiler.ir_text import parse_program\n", "may not import layer 'ir core'"),
    ("kestrel.runtime.gpu", "import torch\n", "imports no torch"),
    ("kestrel.kernels.aot", "from kestrel.compiler.ir import Op\n", "may not import layer 'ir core'"),
    ("kestrel.compiler.onnx_export", "from kestrel.runtime import tensorrt\n", "may not import layer 'runtime'"),
    ("kestrel.compiler.ir", "from kestrel.passes import fuse\n", "may not import layer 'passes'"),
    ("kestrel.compiler.build", "def f():\n    from kestrel.compiler import codegen\n", "inside a function"),
    ("kestrel.runtime.cli", "def f():\n    from kestrel.runtime.cpu import CpuStep\n", None),
    ("kestrel.runtime.cpu", "import torch\nfrom kestrel.compiler.ops import OPS\n", None),
    ("kestrel.runtime.cli", "from kestrel.runtime.cpu import CpuStep\n", "imported only where it runs"),
])
def test_the_checker_catches_each_rule(name, source, expect):
    got = violations(name, source, set(modules()))
    if expect is None:
        assert got == []
    else:
        assert len(got) == 1 and expect in got[0], got
