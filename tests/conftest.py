import os
import subprocess
import sys

# Triton kernels run in the interpreter in this suite; this must precede any import of triton.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The repository's top-level folders (kernels/, runtime/, ...) install as kestrel.*; on the import path
# under their own names they shadow distributions of those names. transformers >= 5.25 imports the
# Hugging Face `kernels` package when it is installed (it is a dependency), and `python -m pytest` and
# pytest-xdist's workers put the working directory first on sys.path and PYTHONPATH. So the repository
# root leaves both here, and PYTHONSAFEPATH keeps `python -c` children from adding their working directory.
def _not_repo(entry: str) -> bool:
    return os.path.abspath(entry or os.curdir) != REPO


sys.path[:] = [p for p in sys.path if _not_repo(p)]
_pythonpath = os.pathsep.join(p for p in os.environ.pop("PYTHONPATH", "").split(os.pathsep) if p and _not_repo(p))
if _pythonpath:
    os.environ["PYTHONPATH"] = _pythonpath
os.environ["PYTHONSAFEPATH"] = "1"


@pytest.fixture(scope="session")
def tiny_plan(tmp_path_factory):
    from kestrel.compiler.build import build

    path = str(tmp_path_factory.mktemp("tiny") / "tiny.plan")
    build("tiny", path, max_seq=256, log=lambda m: None, progress=False)
    return path


class _Zygote:
    """tests/cli_zygote.py: one process that has imported kestrelc and kestrel-run and forks a child per command (a
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
def _interpreter_without_redundant_patches():
    """kernel_harness.skip_redundant_lang_patches for the session's interpreted kernels."""
    from kernel_harness import skip_redundant_lang_patches

    restore = skip_redundant_lang_patches()
    yield
    restore()


@pytest.fixture(scope="session", autouse=True)
def _close_zygote():
    yield
    _Zygote.close()


# --- pytest-xdist (pyproject.toml's addopts: -n auto --dist loadfile --no-loadscope-reorder) ---------------

# Seconds each file's tests took on one of the two workers on the 2-core machine (stop 52's fresh clone, empty Triton
# cache; test_numerics then cut as estimated; files under 8 s left out): under xdist the files are handed out longest
# first, so that the last ones to start are short and the workers end together. A file not listed counts as
# DEFAULT_FILE_SECONDS; stale figures cost only balance.
FILE_SECONDS = {
    "test_launch_plan_interpreted.py": 404, "test_kernels_attention.py": 157, "test_kernels_moe.py": 129,
    "test_speculative.py": 128, "test_kernels_attn_rows.py": 123, "test_runtime_gpu_stub_driver.py": 121,
    "test_kernels_small.py": 99, "test_kernels_norm_matvec.py": 90, "test_kernels_speculative.py": 77,
    "test_numerics.py": 70, "test_cli_trust.py": 64, "test_kernels_gdn_rows.py": 61, "test_oracle_next.py": 55,
    "test_hub_cache.py": 51, "test_prefill_rows.py": 51, "test_spec_sampling_many.py": 45,
    "test_kernels_matvec_rows.py": 42, "test_oracle.py": 40, "test_kernels_matvec.py": 36, "test_kernels_q4_mma.py": 34,
    "test_kernels_gemm.py": 30, "test_spec_sampling.py": 27, "test_bounded_memory.py": 26, "test_onnx.py": 25,
    "test_install.py": 22, "test_spec_sampling_e2e.py": 21, "test_kernels_gdn.py": 18, "test_kernels_bf16_mma.py": 16,
    "test_launch_rules.py": 14, "test_runtime_cpu.py": 12, "test_runtime_gpu_without_gpu.py": 11,
    "test_kernels_q4_stream.py": 10,
}
DEFAULT_FILE_SECONDS = 5


def _xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_collection_modifyitems(session, config, items):
    """Under xdist, the files longest first (FILE_SECONDS; each file's tests keep their order, and
    --dist loadfile keeps a file on one worker, so module fixtures are made once)."""
    if _xdist_worker(config):
        items.sort(key=lambda item: -FILE_SECONDS.get(os.path.basename(str(item.path)), DEFAULT_FILE_SECONDS))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per core the process may use; none (the tests run in this process, as without
    xdist) with a single core, or when the arguments name at most one test file (a file is one worker's
    work under --dist loadfile: starting workers would only add their start-up).
    PYTEST_XDIST_AUTO_NUM_WORKERS overrides."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # (xdist's own hook reads it)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    files = set()
    for arg in config.args:
        path = os.path.abspath(arg.split("::")[0])
        if not os.path.isfile(path):
            files = None  # a folder (testpaths included): many files
            break
        files.add(path)
    if cores < 2 or files is not None and len(files) <= 1:
        return 0
    return cores


def run_cli(*args, env=None, stdin=None):
    """Run a console entry point in a subprocess; returns CompletedProcess (text). ``kestrelc`` and ``kestrel-run``
    with the default environment run in a child forked from a process that has already imported them (_Zygote):
    the same process a plain subprocess is once its imports are done."""
    timeout = 600
    if env is None:  # the CLIs run as a user runs them: compiled kernels, not the interpreter
        clean = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if args[0] in ("kestrelc", "kestrel-run") and os.environ.get("KESTREL_TEST_NO_ZYGOTE") != "1":
            return _Zygote.run(args[0], args[1:], clean, stdin, timeout)
        env = clean
    cmd = [sys.executable, "-c", "import sys; from kestrel.{} import main; sys.argv[0]='{}'; main()".format(
        "compiler.cli" if args[0] == "kestrelc" else "runtime.cli", args[0])] + list(args[1:])
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, input=stdin)
