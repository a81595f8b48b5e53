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


class _Zygote:
    """tests/cli_zygote.py: one process that has imported kestrelc and forks a child per command (a
    plain subprocess spends ~3 s importing torch and Triton first). Started on first use, for the
    session; KESTREL_TEST_NO_ZYGOTE=1 runs every command as a plain subprocess instead."""

    proc = None
    folder = None

    @classmethod
    def run(cls, prog, args, env, stdin, timeout):
        import json
        import tempfile

        if cls.proc is None or cls.proc.poll() is not None:
            cls.folder = tempfile.mkdtemp(prefix="kestrel-cli-")
            cls.proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tests", "cli_zygote.py")],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            assert cls.proc.stdout.readline() == "ready\n", "the kestrelc zygote did not start"
        paths = {k: os.path.join(cls.folder, k) for k in ("stdin", "out", "err")}
        if stdin is not None:
            with open(paths["stdin"], "w") as f:
                f.write(stdin)
        req = {"prog": prog, "args": list(args), "env": dict(env), "cwd": os.getcwd(),
               "stdin": paths["stdin"] if stdin is not None else None, "out": paths["out"], "err": paths["err"],
               "timeout": timeout}
        cls.proc.stdin.write(json.dumps(req) + "\n")
        cls.proc.stdin.flush()
        reply = json.loads(cls.proc.stdout.readline())
        cmd = [prog] + list(args)
        if reply.get("timeout"):
            raise subprocess.TimeoutExpired(cmd, timeout)
        out, err = (open(paths[k]).read() for k in ("out", "err"))  # (decoded as subprocess.run(text=True) does)
        return subprocess.CompletedProcess(cmd, reply["rc"], out, err)

    @classmethod
    def close(cls):
        import shutil

        if cls.proc is not None:
            cls.proc.stdin.close()
            cls.proc.wait(timeout=60)
            cls.proc = None
        if cls.folder:
            shutil.rmtree(cls.folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _close_zygote():
    yield
    _Zygote.close()


def pytest_collection_finish(session):
    """Start training test_numerics' byte models in the background (hf_checkpoints.TrainedInBackground) when
    one of its tests will run."""
    if os.environ.get("KESTREL_TEST_NO_PREFETCH") != "1" and any(
            "trained" in getattr(item, "fixturenames", ()) and item.module.__name__ == "test_numerics"
            for item in session.items):
        from hf_checkpoints import TrainedInBackground

        TrainedInBackground.start()


def pytest_sessionfinish(session):
    if "hf_checkpoints" in sys.modules:
        sys.modules["hf_checkpoints"].TrainedInBackground.stop()


def run_cli(*args, env=None, stdin=None):
    """Run a console entry point in a subprocess; returns CompletedProcess (text). ``kestrelc`` with the
    default environment runs in a child forked from a process that has already imported it (_Zygote):
    the same process a plain subprocess is once its imports are done."""
    timeout = 600
    if env is None:  # the CLIs run as a user runs them: compiled kernels, not the interpreter
        clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if args[0] == "kestrelc" and os.environ.get("KESTREL_TEST_NO_ZYGOTE") != "1":
            return _Zygote.run(args[0], args[1:], clean, stdin, timeout)
        env = clean
    cmd = [sys.executable, "-c", "import sys; from kestrel.{} import main; sys.argv[0]='{}'; main()".format(
        "compiler.cli" if args[0] == "kestrelc" else "runtime.cli", args[0])] + list(args[1:])
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, input=stdin)
