import os
import subprocess
import sys

# Triton kernels run in the interpreter in this suite; this must precede any import of triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session")
def tiny_plan(tmp_path_factory):
    from kestrel.compiler.build import build

    path = str(tmp_path_factory.mktemp("tiny") / "tiny.plan")
    build("tiny", path, max_seq=256, log=lambda m: None, progress=False)
    return path


def run_cli(*args, env=None, stdin=None):
    """Run a console entry point in a subprocess; returns CompletedProcess (text)."""
    cmd = [sys.executable, "-c", "import sys; from kestrel.{} import main; sys.argv[0]='{}'; main()".format(
        "compiler.cli" if args[0] == "kestrelc" else "runtime.cli", args[0])] + list(args[1:])
    if env is None:  # the CLIs run as a user runs them: compiled kernels, not the interpreter
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, input=stdin)
