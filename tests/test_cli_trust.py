"""A command line a user can trust: outputs that never destroy a file, one `error:` line for every bad
input, clean signals, reproducible plans, and the conveniences (--version, help, streamed text).
Files and links are made inside temporary folders; device nodes are stood in for by FIFOs."""
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import click
import click.testing
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conftest import REPO, run_cli
from kestrel.artifacts.errors import (CheckpointError, ConfigError, InputError, OutputError, exit_on_error,
                                      run_command)
from kestrel.compiler.presets import synthesize


def one_error_line(r, code):
    """The exit code, and one ``error:`` line, the last thing printed (build logs may come before it)."""
    assert r.returncode == code, (r.returncode, r.stderr)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0] and "Traceback" not in r.stderr, r.stderr
    return errors[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synthesize("tiny", str(tmp_path_factory.mktemp("ckpt")))


def _copy(ckpt, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, dst)
    return dst


def _snapshot(folder):
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}


# --- outputs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["model.safetensors", "config.json", "tokenizer.json"])
def test_build_refuses_to_write_over_its_own_input(ckpt, tmp_path, target):
    c = _copy(ckpt, tmp_path)
    before = _snapshot(c)
    line = one_error_line(run_cli("kestrelc", "build", c, "-o", os.path.join(c, target)), OutputError.exit_code)
    assert "which this command reads" in line
    os.symlink(os.path.join(c, target), str(tmp_path / "link.plan"))  # through a link, too
    one_error_line(run_cli("kestrelc", "build", c, "-o", str(tmp_path / "link.plan")), OutputError.exit_code)
    assert _snapshot(c) == before


def test_build_refuses_what_is_not_a_regular_file(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    os.symlink(fifo, str(tmp_path / "to-fifo"))
    (tmp_path / "folder").mkdir()
    for out, why in ((fifo, "is a FIFO"), (str(tmp_path / "to-fifo"), "is a FIFO"),
                     (str(tmp_path / "folder"), "is a folder"), (str(tmp_path / "folder") + "/", "is a folder"),
                     ("", "empty path"), (str(tmp_path / "no" / "m.plan"), "does not exist")):
        line = one_error_line(run_cli("kestrelc", "build", "tiny", "-o", out), OutputError.exit_code)
        assert why in line, (out, line)
    assert os.path.exists(fifo) and not os.path.isfile(fifo) and sorted(os.listdir(tmp_path)) == [
        "fifo", "folder", "to-fifo"]


def test_build_writes_through_a_symlink(tmp_path):
    real = tmp_path / "real.plan"
    real.write_bytes(b"old")
    os.symlink(str(real), str(tmp_path / "link.plan"))
    r = run_cli("kestrelc", "build", "tiny", "-o", str(tmp_path / "link.plan"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert os.path.islink(tmp_path / "link.plan") and real.read_bytes()[:8] != b"old"
    assert sorted(os.listdir(tmp_path)) == ["link.plan", "real.plan"]


def test_export_onnx_and_dump_check_their_outputs(tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    one_error_line(run_cli("kestrelc", "export-onnx", "tiny", "-o", fifo), OutputError.exit_code)
    plan = str(tmp_path / "t.plan")
    assert run_cli("kestrelc", "build", "tiny", "-o", plan, "--quiet").returncode == 0
    for dump, why in ((plan, "is not a folder"), (str(tmp_path / "a" / "b"), "does not exist")):
        line = one_error_line(run_cli("kestrel-run", plan, "--prompt-ids", "1,2", "--max-new-tokens", "2",
                                      "--dump", dump), OutputError.exit_code)
        assert why in line
    d = tmp_path / "dump"
    d.mkdir()
    (d / "step00099.logits.f32").write_bytes(b"stale")
    (d / "notes.txt").write_text("mine")
    assert run_cli("kestrel-run", plan, "--prompt-ids", "1,2", "--max-new-tokens", "2", "--dump", str(d)).returncode == 0
    assert not (d / "step00099.logits.f32").exists() and (d / "notes.txt").read_text() == "mine"
    assert len(json.load(open(d / "index.json"))["steps"]) == 3


def test_unwritable_folder_and_full_disk_are_one_line_and_leave_nothing(tmp_path, monkeypatch):
    """The probe's and the writer's OSErrors (a read-only folder, ENOSPC), made in-process: this suite
    may run as root, which no file mode stops."""
    import tempfile

    from kestrel.artifacts import container
    from kestrel.compiler.build import build

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    with monkeypatch.context() as m:
        m.setattr(tempfile, "mkstemp", read_only)
        with pytest.raises(OutputError, match="cannot write in .*Read-only file system"):
            build("tiny", str(tmp_path / "m.plan"), log=lambda s: None, progress=False)

    class Full:
        def __init__(self, path, mode):
            self.f, self.n = open(path, mode), 0

        def write(self, b):
            self.n += len(b)
            if self.n > 100_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(container, "open", Full, raising=False)
    with pytest.raises(OutputError, match="writing .* failed \\(No space left on device\\); nothing was left behind"):
        build("tiny", str(tmp_path / "m.plan"), log=lambda s: None, progress=False)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder anyway")
def test_read_only_folder(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    line = one_error_line(run_cli("kestrelc", "build", "tiny", "-o", str(ro / "m.plan")), OutputError.exit_code)
    assert "cannot write in" in line


# --- bad input: one line ------------------------------------------------------------------------------

@pytest.mark.parametrize("case, message", [
    ("not_utf8", "not UTF-8"), ("a_folder", "is a folder"), ("nan_weight", "non-finite"),
    ("inf_weight", "non-finite"), ("shard_outside", "outside the checkpoint folder"),
    ("shard_absolute", "outside the checkpoint folder")])
def test_bad_checkpoints(ckpt, tmp_path, case, message):
    c = _copy(ckpt, tmp_path)
    cfg_path, st_path = os.path.join(c, "config.json"), os.path.join(c, "model.safetensors")
    if case == "not_utf8":
        open(cfg_path, "wb").write(b'{"model_type": "\xff\xfe"}')
    elif case == "a_folder":
        os.remove(cfg_path)
        os.mkdir(cfg_path)
    elif case in ("nan_weight", "inf_weight"):
        t = load_file(st_path)
        t["model.layers.2.mlp.down_proj.weight"][3, 5] = np.nan if case == "nan_weight" else np.inf
        save_file(t, st_path)
    else:
        names = sorted(load_file(st_path))
        shard = "../outside.safetensors" if case == "shard_outside" else os.path.abspath(st_path)
        json.dump({"weight_map": {n: shard for n in names}},
                  open(os.path.join(c, "model.safetensors.index.json"), "w"))
        os.remove(st_path)
    out = tmp_path / "out"
    out.mkdir()
    code = ConfigError.exit_code if case in ("not_utf8", "a_folder") else CheckpointError.exit_code
    line = one_error_line(run_cli("kestrelc", "build", c, "-o", str(out / "m.plan")), code)
    assert message in line and (case not in ("nan_weight", "inf_weight") or "down_proj" in line), line
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("args, message", [
    (["--device", "tpu"], "'tpu' is not one of 'auto', 'cpu', 'gpu'"),
    (["--max-new-tokens", "abc"], "'abc' is not a valid integer"),
    (["--nope"], "No such option '--nope'"),
])
def test_usage_errors_are_one_line_exit_2(tiny_plan, args, message):
    line = one_error_line(run_cli("kestrel-run", tiny_plan, "--prompt", "hi", *args), 2)
    assert message in line and "kestrel-run --help" in line
    line = one_error_line(run_cli("kestrelc", "build", "tiny", "-o", "x.plan", "--q4-group", "x"), 2)
    assert "'x' is not one of '32', '64', '128'" in line


@pytest.mark.parametrize("ids", ["1 2 3", "1_0", "1,,2", "١,2", "", "-1", "1;2"])
def test_prompt_ids_are_parsed_strictly(tiny_plan, ids):
    line = one_error_line(run_cli("kestrel-run", tiny_plan, "--prompt-ids", ids), InputError.exit_code)
    assert "--prompt-ids" in line


def test_prompt_ids_with_spaces_around_commas(tiny_plan):
    r = run_cli("kestrel-run", tiny_plan, "--prompt-ids", " 1, 2 ,3", "--max-new-tokens", "2", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["prompt_tokens"] == 3, r.stderr


@pytest.mark.parametrize("t", ["nan", "inf", "1e-45", "-1"])
def test_bad_temperature(tiny_plan, t):
    line = one_error_line(run_cli("kestrel-run", tiny_plan, "--prompt", "hi", "--temperature", t),
                          InputError.exit_code)
    assert "--temperature" in line


@pytest.mark.parametrize("args, message", [(["--max-seq", "1"], "--max-seq 1: must be between 2"),
                                           (["--seed", "-5", "--weights", "random"], "--seed -5")])
def test_build_values_a_plan_could_not_serve(tmp_path, args, message):
    line = one_error_line(run_cli("kestrelc", "build", "tiny", "-o", str(tmp_path / "m.plan"), *args),
                          InputError.exit_code)
    assert message in line and not os.listdir(tmp_path)


def test_gpu_plan_without_a_gpu_says_so(tmp_path):
    plan = str(tmp_path / "g.plan")
    assert run_cli("kestrelc", "build", "tiny", "-o", plan, "--target", "sm_90", "--quiet").returncode == 0
    code = ("import sys; sys.modules['cuda'] = None; from kestrel.runtime.cli import main; "
            f"sys.argv = ['kestrel-run', {plan!r}, '--prompt', 'hi']; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    line = one_error_line(r, 8)
    assert "this plan needs an sm_90 GPU and none is usable here" in line and "--device cpu" in line


def test_cpu_ms_per_token_of_a_short_run(tiny_plan):
    r = run_cli("kestrel-run", tiny_plan, "--prompt", "Hello", "--max-new-tokens", "4", "--json")
    out = json.loads(r.stdout)
    assert out["ms_per_token"] > 0.05, out  # a decode step of tiny on the CPU takes milliseconds, not 0.0007


# --- signals ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_mid_write_leaves_nothing(tmp_path_factory, tmp_path, sig):
    from test_bounded_memory import make_checkpoint

    big = tmp_path_factory.getbasetemp() / "signal-ckpt"
    if not big.exists():
        make_checkpoint(str(big), 16)  # ~270 MB once written as fp32: a write that takes a while
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-c", "import sys; from kestrel.compiler.cli import main; sys.argv[0] = 'kestrelc'; "
           "main()", "build", str(big), "-o", str(out / "m.plan"), "--max-seq", "16"]
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True,
                         env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    deadline = time.time() + 120
    while not any(f.startswith("m.plan.partial-") for f in os.listdir(out)):
        assert p.poll() is None and time.time() < deadline, "the build ended before it was signalled"
        time.sleep(0.002)
    p.send_signal(sig)
    err = p.communicate(timeout=120)[1]
    assert p.returncode == 128 + sig, err
    assert f"interrupted ({signal.Signals(sig).name})" in err and "Traceback" not in err
    assert os.listdir(out) == []


# --- reproducible plans --------------------------------------------------------------------------------

def test_same_build_same_bytes_anywhere(tmp_path):
    """The same build in two folders gives the same bytes: once with the session's Triton cache (whatever the
    tests before compiled), once with a cold cache of its own (every kernel compiled anew)."""
    plans = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        if name == "b":
            env["TRITON_CACHE_DIR"] = str(folder / "triton-cache")  # a cold, separate cache
        r = subprocess.run([sys.executable, "-c", "import sys; from kestrel.compiler.cli import main; "
                            "sys.argv[0] = 'kestrelc'; main()", "build", "tiny", "-o", "m.plan", "--target", "sm_90",
                            "--quiet"], cwd=folder, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        plans.append((folder / "m.plan").read_bytes())
    assert plans[0] == plans[1]
    assert REPO.encode() not in plans[0] and b".py" not in plans[0]  # no source path in any cubin
    r = run_cli("kestrelc", "inspect", str(tmp_path / "a" / "m.plan"))
    assert "content   sha256:" in r.stdout


# --- conveniences ----------------------------------------------------------------------------------

def test_version_and_help_for_every_option():
    from kestrel.compiler.cli import cli
    from kestrel.runtime.cli import command

    for prog, args in (("kestrelc", ["--version"]), ("kestrel-run", ["--version"])):
        r = run_cli(prog, *args)
        assert r.returncode == 0 and r.stdout.startswith(f"{prog} "), r.stderr
    for cmd in [command] + list(cli.commands.values()):
        undocumented = [p.name for p in cmd.params if isinstance(p, click.Option) and not p.help]
        assert not undocumented, (cmd.name, undocumented)
    r = run_cli("kestrelc", "build", "--help")
    assert "qwen3.5-27b" in r.stdout and "--weights random" in r.stdout and "tiny" in r.stdout
    assert "DIR" in run_cli("kestrel-run", "--help").stdout


def test_quiet_build_prints_nothing_and_the_banner_comes_first(tmp_path):
    r = run_cli("kestrelc", "build", "tiny", "-o", str(tmp_path / "q.plan"), "--quiet")
    assert r.returncode == 0 and r.stderr == "" and r.stdout == ""
    r = run_cli("kestrelc", "build", "tiny", "-o", str(tmp_path / "v.plan"))
    assert r.stderr.splitlines()[0].startswith("kestrelc: tiny"), r.stderr


def test_streamed_text_equals_the_whole_and_is_printable(tiny_plan):
    from kestrel.artifacts.plan import load_plan
    from kestrel.runtime.cli import _TextStream, printable
    from kestrel.runtime.tokenizer import PlanTokenizer

    tok = PlanTokenizer(load_plan(tiny_plan).tokenizer_json)
    ids = tok.encode("Grüße, Kestrel! \x07\x1b\nnext line\n\nand one more ünïcödé") + [7, 27, 200]

    @click.command()
    @click.option("--size", type=int)
    def show(size):
        s = _TextStream(tok)
        for i in range(0, len(ids), size):
            s(ids[i:i + size])
            if size == 1 and tok.decode(ids[:i + 1]).endswith("\n"):
                assert s.ids == []  # started over at the line break: the work per batch stays bounded
        s.close()

    for size in (1, 3):  # one token a batch: every line break resets the stream
        r = click.testing.CliRunner().invoke(show, ["--size", str(size)])
        assert r.exit_code == 0, r.output
        out = r.output
        assert out == printable(tok.decode(ids)) + "\n"
        assert "\\x07" in out and "\\x1b" in out and "\x07" not in out and "Grüße" in out
    r = run_cli("kestrel-run", tiny_plan, "--prompt", "Hello", "--max-new-tokens", "16")
    assert r.returncode == 0 and all(c.isprintable() or c == "\n" for c in r.stdout), repr(r.stdout)


def test_exit_on_error_maps_signals():
    @exit_on_error
    def stopped():
        raise KeyboardInterrupt(signal.SIGTERM)

    with pytest.raises(SystemExit) as e:
        stopped()
    assert e.value.code == 128 + signal.SIGTERM

    @click.command()
    @click.option("--n", type=int, help="a number")
    def cmd(n):
        pass

    with pytest.raises(SystemExit) as e:
        sys.argv = ["x", "--n", "z"]
        run_command(cmd, "x")
    assert e.value.code == 2


def test_unreadable_config_is_one_line(ckpt, tmp_path, monkeypatch):
    """A permission problem on config.json (made in-process: root reads any file)."""
    import builtins

    from kestrel.compiler import frontend

    c = _copy(ckpt, tmp_path)
    real_open = builtins.open

    def guarded(path, *a, **k):
        if str(path).endswith("config.json"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(frontend, "open", guarded, raising=False)
    with pytest.raises(ConfigError, match="config.json: permission denied; make it readable"):
        frontend.read_config(c)


def test_inspect_shows_small_sizes_in_kb(tiny_plan):
    r = run_cli("kestrelc", "inspect", tiny_plan)
    assert r.returncode == 0 and "dyn 0.26 kB" in r.stdout and "0.00 MB" not in r.stdout, r.stdout
