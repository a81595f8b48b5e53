"""A non-editable ``pip install .`` into a fresh venv imports and runs, and installs nothing generic
at the top level of site-packages (only the ``kestrel`` namespace and its dist-info)."""
import glob
import os
import subprocess
import sys
import sysconfig

from conftest import REPO


def test_wheel_install_in_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # --no-deps: the dependencies come from this environment through a .pth line below, so the test
    # needs no network; the package itself is built and installed as a regular wheel
    r = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", REPO], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    sp = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        capture_output=True, text=True, check=True).stdout.strip()
    ours = {os.path.basename(p) for p in glob.glob(os.path.join(sp, "*"))
            if "kestrel" in os.path.basename(p).lower()}
    assert ours == {"kestrel", next(n for n in ours if n.endswith(".dist-info"))}, ours
    for generic in ("compiler", "passes", "runtime", "kernels", "artifacts", "tests"):
        assert not os.path.exists(os.path.join(sp, generic)), f"{generic} installed at the top level"
    with open(os.path.join(sp, "outer-deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    env = dict(os.environ, PYTHONPATH="")
    check = ("import kestrel.compiler.cli, kestrel.runtime.cli, kestrel.passes, kestrel.kernels, kestrel.artifacts.plan;"
             "print(kestrel.compiler.cli.__file__)")
    r = subprocess.run([py, "-c", check], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().startswith(sp), r.stdout  # the installed copy, not the source tree
    plan = str(tmp_path / "tiny.plan")
    r = subprocess.run([str(venv / "bin" / "kestrelc"), "build", "tiny", "-o", plan, "--quiet"], capture_output=True,
                       text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(venv / "bin" / "kestrel-run"), plan, "--prompt", "Hi", "--max-new-tokens", "4"],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
