"""The GPU runtime on a machine with no GPU: clear errors, and no torch on its import path."""
import subprocess
import sys

import pytest

from conftest import run_cli
from kestrel.artifacts.errors import DeviceError, UnsupportedError


@pytest.fixture(scope="module")
def sm90_plan(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpu") / "tiny-sm90.plan")
    r = run_cli("kestrelc", "build", "tiny", "-o", path, "--target", "sm_90", "--max-seq", "64")
    assert r.returncode == 0, r.stderr
    return path


def test_gpu_path_imports_no_torch(sm90_plan):
    # torch made unimportable: the GPU path must still get as far as asking for the driver
    code = ("import sys; sys.modules['torch'] = None; from kestrel.runtime.cli import main; "
            f"sys.argv = ['kestrel-run', {sm90_plan!r}, '--prompt', 'hi']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        import cuda.bindings.driver as cu  # noqa: F401
        cu.cuInit(0)
        pytest.skip("a CUDA driver is present here")
    except (ImportError, RuntimeError):
        pass
    assert r.returncode == DeviceError.exit_code, r.stderr
    assert "no CUDA driver" in r.stderr and "--device cpu" in r.stderr and "Traceback" not in r.stderr


def test_gpu_plan_runs_on_cpu_reference(sm90_plan):
    r = run_cli("kestrel-run", sm90_plan, "--prompt", "hi", "--max-new-tokens", "3", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr


def test_cpu_plan_on_gpu_is_refused(tiny_plan):
    r = run_cli("kestrel-run", tiny_plan, "--prompt", "hi", "--device", "gpu")
    assert r.returncode == UnsupportedError.exit_code and "rebuild with --target sm_XX" in r.stderr
