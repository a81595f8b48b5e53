"""A pre-imported ``kestrelc`` and ``kestrel-run`` that fork one child per command (tests/conftest.py ``run_cli``).

``kestrelc`` imports torch and Triton at the top of its modules, ``kestrel-run`` torch when it runs a plan on the
CPU path: every subprocess the suite starts for them spends ~3 s importing before it does anything, and the suite
starts dozens of each (most of them to check one error line or a few tokens of the tiny model). This process
imports ``kestrel.compiler.cli``, ``kestrel.runtime.cli`` and the CPU path once, in the environment a plain
``run_cli`` child gets (the test process's, without TRITON_INTERPRET), and then, per request, forks a
child that is what that subprocess would be right after its imports: its own process, its own standard
streams (files), argv, environment, working folder and exit status (``main()``'s SystemExit code; an
uncaught exception prints its traceback and exits 1, as Python does; death by a signal: -signal). Each
child starts from this process's untouched state: nothing one command does reaches the next. (A ``kestrel-run``
child has more imported than a plain one, the compiler and Triton among them: what the GPU runtime may import is
checked by tests/test_runtime_gpu_stub_driver.py in plain subprocesses with torch and Triton made unimportable.)

Protocol: one JSON request a line on stdin, {"prog", "args", "env", "cwd", "stdin", "out", "err",
"timeout"}; one JSON reply a line on stdout, {"rc"} or {"timeout": true} (the child killed)."""
import json
import os
import sys
import time
import traceback

sys.path[0] = ""  # as under ``python -c``: the working folder first, not tests/

from kestrel.compiler.cli import main as kestrelc_main  # noqa: E402  (the imports every child shares)
from kestrel.runtime import cpu as _cpu_path  # noqa: E402,F401  (kestrel-run's CPU path: torch and the references)
from kestrel.runtime.cli import main as kestrel_run_main  # noqa: E402

MAINS = {"kestrelc": kestrelc_main, "kestrel-run": kestrel_run_main}


def _child(req):
    fd_in = os.open(req["stdin"] or os.devnull, os.O_RDONLY)
    fd_out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    fd_err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, std in ((fd_in, 0), (fd_out, 1), (fd_err, 2)):
        os.dup2(fd, std)
        os.close(fd)
    # fresh standard streams on the new descriptors, as a new interpreter would open them
    sys.stdin = sys.__stdin__ = open(0, "r", closefd=False)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)
    sys.stderr = sys.__stderr__ = open(2, "w", closefd=False, errors="backslashreplace")
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    sys.argv = [req["prog"]] + list(req["args"])
    code = 0
    try:
        MAINS[req["prog"]]()
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    try:
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


def serve():
    reply = sys.stdout
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(req)
        deadline = time.monotonic() + req["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                reply.write(json.dumps({"timeout": True}) + "\n")
                break
            time.sleep(0.002)
        reply.flush()


if __name__ == "__main__":
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    serve()
