"""The GPU runtime's whole load-and-generate path, for a random-weight plan and a checkpoint plan, with
torch and triton unimportable and a stub CUDA driver (tests/stubs/cuda/bindings/driver.py) in place
of cuda.bindings: the launch plan is the runtime's only input, and the GPU path imports nothing of the
compiler, the kernels, torch or Triton. The stub answers on any machine, so this test never skips
(with or without a GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from kestrel.artifacts.plan import load_plan
from kestrel.runtime.gpu import PDL_TRIAL_STEPS

STUBS = os.path.join(REPO, "tests", "stubs")
RUN = r"""
import json, sys
sys.modules["torch"] = None  # import torch -> ImportError
sys.modules["triton"] = None
sys.path.insert(0, {stubs!r})
from cuda.bindings import driver as stub
from kestrel.runtime.cli import main
sys.argv = ["kestrel-run", {plan!r}, "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--json"] + {extra!r}
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
forbidden = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton") and sys.modules[m] is not None
                   or m.startswith(("kestrel.compiler", "kestrel.kernels", "kestrel.passes")))
print(json.dumps({{"calls": stub.CALLS, "launches": stub.LAUNCHES, "forbidden": forbidden,
                   "driver": stub.__file__, "edges": list(stub.GRAPH_EDGES.values()),
                   "attributes": stub.FUNC_ATTRIBUTES}}))
"""


@pytest.fixture(scope="module", params=["random", "checkpoint"])
def plan(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stub") / f"tiny-{request.param}.plan")
    r = run_cli("kestrelc", "build", "tiny", "-o", path, "--target", "sm_90", "--max-seq", "32",
                "--weights", request.param)
    assert r.returncode == 0, r.stderr
    return request.param, path


@pytest.mark.parametrize("extra", [[], ["--no-graph"]])
def test_gpu_runtime_runs_on_the_launch_plan_alone(plan, extra):
    kind, path = plan
    r = subprocess.run([sys.executable, "-c", RUN.format(stubs=STUBS, plan=path, extra=extra)],
                       capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                            if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    out, report = json.loads(lines[-2]), json.loads(lines[-1])
    assert report["driver"].startswith(STUBS)  # the stub, not a real driver
    assert report["forbidden"] == [], report["forbidden"]
    assert out["weights"] == kind and out["mode"] == ("gpu-stream" if extra else "gpu-graph")
    lp = load_plan(path).launch_plan
    names = [k["name"] for k in lp["kernels"]]
    step = [names[launch["kernel_index"]] for launch in lp["launches"]]
    fill = [names[launch["kernel_index"]] for launch in lp["fill"]]
    launched = [name for name, *_ in report["launches"]]
    calls = report["calls"]
    # load: the fill launches (random weights) or one upload per weight (checkpoint), then the steps
    if kind == "random":
        assert fill and launched[:len(fill)] == fill
        assert calls["cuMemcpyHtoDAsync"] == 2  # the request's one host write: dyn slots + prompt ids
    else:
        assert not fill and calls["cuMemcpyHtoDAsync"] == len(lp["weights"]) + 2
    # with the graphs: at load, the step's plain and programmatic graphs, and the programmatic one of the
    # late-trigger kernels (the tiny plan's matvecs have them), replayed in turn (the PDL trial)
    assert any("late" in k for k in lp["kernels"])
    trial = 0 if extra else 3 * (1 + PDL_TRIAL_STEPS)
    assert launched[len(fill):len(fill) + trial * len(step)] == step * trial
    rows = [names[launch["kernel_index"]] for launch in lp["prefill"]["launches"]]
    start = len(fill) + trial * len(step)
    assert launched[start:start + len(rows)] == rows  # the 3-token prompt: one run of the M-row step
    steps = launched[start + len(rows):]
    n_steps = len(steps) // len(step)
    assert steps == step * n_steps and n_steps == 6 - 1  # then one step per new token after the first
    assert calls.get("cuGraphLaunch", 0) == (0 if extra else trial + 1 + n_steps)  # --no-graph: neither graph
    assert calls["cuModuleLoadData"] == len(lp["kernels"])


def run_stub(plan_path, extra, **env):
    r = subprocess.run([sys.executable, "-c", RUN.format(stubs=STUBS, plan=plan_path, extra=extra)],
                       capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                            if k != "TRITON_INTERPRET"} | env)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["forbidden"] == [], report["forbidden"]
    return report


def test_moe_plan_kernels_prefer_the_rules_carveout(plan, tmp_path):
    """A plan with routed experts carries the moe rule's shared-memory carveout on every kernel (kernels/targets.py,
    MoeRule.carveout: 100% on sm_90), and the runtime sets it on each function at load; a dense plan sets none (the
    driver's choice, kernel by kernel)."""
    from kestrel.kernels.targets import TARGETS

    carveout = TARGETS["sm_90"].rules["moe"].carveout
    assert carveout == 100
    kind, dense = plan
    assert all("carveout" not in k for k in load_plan(dense).launch_plan["kernels"])
    assert not any(a.endswith("CARVEOUT") for a in run_stub(dense, [])["attributes"])
    if kind != "random":
        return  # (the MoE plan once)
    path = str(tmp_path / "tiny-next.plan")
    r = run_cli("kestrelc", "build", "tiny-next", "-o", path, "--target", "sm_90", "--quant", "q4", "--max-seq", "32",
                "--weights", "random")
    assert r.returncode == 0, r.stderr
    kernels = load_plan(path).launch_plan["kernels"]
    assert any(k["name"].startswith("moe_topk") for k in kernels)
    step = [k for k in kernels if k["id"] not in ("fill_random", "read_stream")]  # (made after the step's table)
    assert step and all(k["carveout"] == carveout for k in step)
    attributes = run_stub(path, [])["attributes"]
    assert {k["name"] for k in step} == {a.split(":")[0] for a, v in attributes.items()
                                          if a.endswith("PREFERRED_SHARED_MEMORY_CARVEOUT") and v == carveout}
    info = run_cli("kestrelc", "inspect", path).stdout
    assert f"carveout {carveout}%" in info


@pytest.mark.parametrize("env,chained", [({}, True), ({"KESTREL_STUB_PDL_FACTOR": "0.9"}, True),
                                         ({"KESTREL_STUB_PDL_FACTOR": "1.015"}, True),
                                         ({"KESTREL_STUB_PDL_FACTOR": "1.1"}, False), ({"KESTREL_PDL": "1"}, True),
                                         ({"KESTREL_PDL": "0", "KESTREL_STUB_PDL_FACTOR": "0.5"}, False)])
def test_step_graph_keeps_programmatic_edges_when_faster(plan, env, chained, tmp_path):
    """An sm_90 plan's kernels are compiled with the PDL wait (kernels/pdl.py), so the runtime builds the
    step graph twice, with plain and with programmatic edges (from the programmatic port), times both
    at load and keeps programmatic edges unless their steps are more than 2% slower (the stub's virtual
    clock makes them 10% faster, 1.5% or 10% slower; equal times keep programmatic edges). KESTREL_PDL=1 keeps
    programmatic edges untimed, 0 never builds them. The M-row step's graph always has plain edges;
    the stub checks that every graph is a chain in launch order, and --bench reports the choice."""
    _, path = plan
    lp = load_plan(path).launch_plan
    step_kernels = {launch["kernel_index"] for launch in lp["launches"] + lp["prefill"]["launches"]}
    assert all(lp["kernels"][i]["constexprs"]["PDL"] is True for i in step_kernels)
    out = tmp_path / "bench.json"
    report = run_stub(path, ["--bench", str(out)], **env)
    graphs = report["edges"]
    n, rows = len(lp["launches"]) - 1, len(lp["prefill"]["launches"]) - 1
    built = {"0": 1, "1": 2}.get(env.get("KESTREL_PDL"), 3)  # plain; the rule's chained (KESTREL_PDL=1); the late
    assert [len(g) for g in graphs] == [n] * built + [rows]  # step (plain, then chained), then the M-row step
    assert {(t, port) for _, _, t, port in graphs[0]} == {(0, 0)}
    for g in graphs[1:built]:
        assert {(t, port) for _, _, t, port in g} == {(1, 1)}
    assert {(t, port) for _, _, t, port in graphs[-1]} == {(0, 0)}
    assert report["calls"].get("cuGraphExecDestroy", 0) == built - 1  # the graph not kept
    bench = json.loads(out.read_text())
    assert bench["graph_pdl"] is chained
    assert (bench["pdl_trial_ms"] is None) == ("KESTREL_PDL" in env)
    assert bench["graph_pdl_late"] is False  # (the stub's late graph runs as fast as the rule's)


@pytest.mark.parametrize("late_factor,picked", [("0.9", "late"), ("1.0", "programmatic"), ("1.1", "programmatic")])
def test_step_graph_takes_the_late_trigger_kernels_when_faster(plan, late_factor, picked, tmp_path):
    """The trial's third graph, the step chained with the late-trigger variants of its matvecs (compiler/codegen.py:
    a kernel entry's ``late``), is kept when its median step beats the rule's chained graph (a tie keeps the rule's);
    then the streaming launches are the late kernels too."""
    _, path = plan
    lp = load_plan(path).launch_plan
    lates = {i: k["late"] for i, k in enumerate(lp["kernels"]) if "late" in k}
    assert lates and all(lp["kernels"][j]["constexprs"]["PDL_LATE"] is True for j in lates.values())
    assert all(lp["kernels"][i]["constexprs"]["PDL_LATE"] is False for i in lates)
    out = tmp_path / "bench.json"
    report = run_stub(path, ["--bench", str(out)], KESTREL_STUB_PDL_FACTOR="0.95", KESTREL_STUB_LATE_FACTOR=late_factor)
    bench = json.loads(out.read_text())
    assert bench["graph_pdl"] is True and bench["graph_pdl_late"] is (picked == "late")
    med = {k: sorted(v)[len(v) // 2] for k, v in bench["pdl_trial_ms"].items()}
    assert set(med) == {"plain_ms", "programmatic_ms", "late_ms"}
    assert (med["late_ms"] < med["programmatic_ms"]) is (picked == "late")
    assert report["calls"]["cuGraphExecDestroy"] == 2  # the two step graphs not kept


def test_pdl_trial_verdict():
    from kestrel.runtime.gpu import pdl_wins

    assert pdl_wins([1.0, 1.0, 1.2], [0.95, 0.9, 2.0]) and pdl_wins([1.0] * 3, [0.995] * 3)
    assert pdl_wins([1.0] * 5, [1.0] * 5) and pdl_wins([1.0] * 5, [1.015] * 5)  # a tie, or 1.5% behind: chained
    assert not pdl_wins([1.0] * 5, [1.03] * 5) and not pdl_wins([1.0, 1.0, 1.2], [1.05, 1.05, 0.9])


def test_pdl_trial_pick():
    """Of the two chained graphs the faster median (a tie: the rule's kernels), then weighed against plain edges."""
    from kestrel.runtime.gpu import pdl_pick

    assert pdl_pick([1.0] * 3, [0.9] * 3) == "programmatic" and pdl_pick([1.0] * 3, [0.9] * 3, None) == "programmatic"
    assert pdl_pick([1.0] * 3, [0.9] * 3, [0.8] * 3) == "late" and pdl_pick([1.0] * 3, [0.9] * 3, [0.9] * 3) == "programmatic"
    assert pdl_pick([1.0] * 3, [1.2] * 3, [1.01] * 3) == "late"  # the late graph within the margin of plain edges
    assert pdl_pick([1.0] * 3, [1.2] * 3, [1.1] * 3) == "plain" and pdl_pick([1.0] * 3, [1.1] * 3) == "plain"


def test_pdl_is_compiled_in_from_sm_90_only(plan, tmp_path):
    """PDL is a constexpr codegen sets from the target: true from sm_90, false below (no griddepcontrol).
    Every step kernel of the sm_90 plan has it; one kernel of each family has its SASS read (the
    cuobjdump Triton ships): griddepcontrol.wait is ACQBULK, launch_dependents PREEXIT (in the random-weights
    plan: the checkpoint's has the same kernels)."""
    from concurrent.futures import ThreadPoolExecutor

    import triton

    from kestrel.compiler.codegen import with_pdl
    from kestrel.kernels.matvec import matvec_kernel

    kind, path = plan
    plan_ = load_plan(path)
    lp = plan_.launch_plan
    assert with_pdl(matvec_kernel, {}, 80) == {"PDL": False} and with_pdl(matvec_kernel, {}, 90) == {"PDL": True}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    step = [lp["kernels"][i] for i in sorted({launch["kernel_index"]
                                              for launch in lp["launches"] + lp["prefill"]["launches"]})]
    assert all(k["constexprs"]["PDL"] is True for k in step)
    if kind != "random":
        return
    families = list({k["jit"]: k for k in step}.values())

    def sass(k):
        cubin = tmp_path / f"{k['name']}-{k['part'].rsplit('/', 1)[1]}.cubin"
        cubin.write_bytes(plan_.cubin(k["part"]))
        return subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout

    with ThreadPoolExecutor(4) as ex:
        for k, text in zip(families, ex.map(sass, families)):
            assert "ACQBULK" in text and "PREEXIT" in text, k["id"]


def _knockout_launches(lp, names, step, rounds):
    """The launches graph_knockout replays: per kernel (first seen first) the step graph, then ``rounds`` times
    the chain without that kernel's launches and the step graph."""
    out = []
    for kernel in dict.fromkeys(launch["kernel"] for launch in lp["launches"]):
        without = [names[launch["kernel_index"]] for launch in lp["launches"] if launch["kernel"] != kernel]
        out += step + (without + step) * rounds
    return out


def test_profile_launches_kernel_by_kernel_then_replays(plan, tmp_path):
    """--profile: after the prefill, 6 decode steps launched one by one (each launch between its own
    two events, windows of launches behind a stream gate), then 7 graph replays, then each kernel's cost inside
    the graph (the replay less the replay without its launches, alternating); the report charges
    each launch its bytes and divides by the bandwidth measured with the plan's read-only probe."""
    from kestrel.runtime.profile import WINDOW

    _, path = plan
    out = tmp_path / "profile.json"
    report = run_stub(path, ["--profile", str(out)])
    rep = json.loads(out.read_text())
    lp = load_plan(path).launch_plan
    names = [k["name"] for k in lp["kernels"]]
    step = [names[launch["kernel_index"]] for launch in lp["launches"]]
    probe = lp["probes"]["read_stream"]
    launched = [name for name, *_ in report["launches"]]
    reads = [(name, grid) for name, grid, *_ in report["launches"] if name == names[probe["kernel_index"]]]
    assert len(reads) == 11 and all(grid[0] == 8 * 132 for _, grid in reads)  # warm-up + 10 timed, 8 per SM
    knockout = _knockout_launches(lp, names, step, 6)
    tail = launched[-13 * len(step) - len(knockout):]
    assert tail == step * 13 + knockout  # 6 streamed steps, then 1 + 6 graph replays, then the knockout
    calls = report["calls"]
    windows = -(-len(step) // WINDOW)
    assert calls["cuStreamWaitValue32"] == 1 + 6 * windows  # the gate's check, then one per window
    families = {launch["kernel"] for launch in lp["launches"]}
    assert calls["cuGraphLaunch"] == 7 + 1 + 3 * (1 + PDL_TRIAL_STEPS) + 13 * len(families)  # (+1: the
    # prefill's M-row graph; the load-time PDL trial of three graphs; per kernel the full graph, then 6 times without it and with it)
    assert calls["cuGraphDestroy"] == len(families) and sorted(g["kernel"] for g in rep["in_graph"]) == sorted(families)
    assert all(g["launches"] == sum(launch["kernel"] == g["kernel"] for launch in lp["launches"])
               and g["in_graph_ms"] == pytest.approx(g["graph_ms"] - g["without_ms"]) for g in rep["in_graph"])
    # each kernel's floor: its launches' bytes (the by-kernel table's) at the run's bandwidth, and the time over it
    bw = rep["bandwidth"]["used_GBps"] * 1e9
    assert sum(g["bytes"] for g in rep["in_graph"]) == pytest.approx(rep["bytes_per_step"])
    assert all(g["bytes"] == rep["by_kernel"][g["kernel"]]["bytes"] and g["floor_ms"] == pytest.approx(g["bytes"] / bw * 1e3)
               and g["over_floor_ms"] == pytest.approx(g["in_graph_ms"] - g["floor_ms"]) for g in rep["in_graph"])
    assert sum(g["floor_ms"] for g in rep["in_graph"]) == pytest.approx(rep["roofline_ms"])
    from kestrel.runtime.profile import format_report

    text = format_report(rep).splitlines()
    at = text.index(next(line for line in text if line.startswith("in the graph")))
    assert [line.split()[0] for line in text[at + 3:at + 3 + len(families)]] == [g["kernel"] for g in rep["in_graph"]]
    assert "floor us" in text[at] and text[at + 3 + len(families)].startswith("(sum)")
    assert float(text[at + 3 + len(families)].split()[-2]) == pytest.approx(rep["roofline_ms"] * 1e3, abs=0.1)
    assert rep["launches_per_step"] == len(step) and rep["decode_steps"] == 6 and rep["host_gaps_hidden"]
    assert rep["bandwidth"]["read_GBps"] > 0 and rep["bandwidth"]["used_GBps"] == max(
        rep["bandwidth"]["read_GBps"], rep["bandwidth"]["copy_GBps"])
    assert rep["sum_of_launches_ms"] == pytest.approx(0.01 * len(step))  # the stub's 0.01 ms per event pair
    assert rep["fraction_of_roofline_graph"] == pytest.approx(rep["roofline_ms"] / rep["graph_replay_ms"])


def test_profile_times_the_m_row_step_too(tmp_path):
    """A plan with an M-row step: --profile first launches its program kernel by kernel over 6 full chunks
    of a prompt of 7 chunks (positions 0, 4, ... 20), then replays its graph 1 + 6 times, and reports it
    under ``prefill`` beside the decode step's tables."""
    path = str(tmp_path / "tiny-m4.plan")
    r = run_cli("kestrelc", "build", "tiny", "-o", path, "--target", "sm_90", "--max-seq", "64", "--weights", "random",
                "--prefill-rows", "4")
    assert r.returncode == 0, r.stderr
    out = tmp_path / "profile.json"
    report = run_stub(path, ["--profile", str(out)])
    rep = json.loads(out.read_text())
    lp = load_plan(path).launch_plan
    names = [k["name"] for k in lp["kernels"]]
    rows = [names[launch["kernel_index"]] for launch in lp["prefill"]["launches"]]
    step = [names[launch["kernel_index"]] for launch in lp["launches"]]
    launched = [name for name, *_ in report["launches"]]
    start = next(i for i in range(len(launched)) if launched[i:i + len(rows)] == rows)
    assert launched[start:start + 6 * len(rows)] == rows * 6  # the 6 profiled chunks, one by one
    knockout = _knockout_launches(lp, names, step, 6)
    assert launched[-13 * len(step) - len(knockout):] == step * 13 + knockout  # then the decode step's profile
    p = rep["prefill"]
    assert p["rows"] == 4 and p["launches_per_step"] == len(rows) and p["decode_steps"] == 6
    assert [int(x["index"]) for x in p["launches"]] == list(range(len(rows)))
    assert p["mean_position"] == pytest.approx(10.0)  # chunks at 0, 4, ..., 20
    assert p["sum_of_launches_ms"] == pytest.approx(0.01 * len(rows)) and "graph_replay_ms" in p
    assert p["bytes_per_step"] > 0 and p["roofline_ms"] > 0
    text = run_cli("kestrel-run", path, "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--profile", "--device", "cpu")
    assert text.returncode == 0, text.stderr  # (the CPU path profiles the one-token step only)


def test_bench_reports_both_bandwidths(plan, tmp_path):
    _, path = plan
    out = tmp_path / "bench.json"
    run_stub(path, ["--bench", str(out)])
    r = json.loads(out.read_text())
    assert r["read_bandwidth_GBps"] > 0 and r["copy_bandwidth_GBps"] > 0
    assert r["bandwidth_GBps"] == max(r["read_bandwidth_GBps"], r["copy_bandwidth_GBps"])
    assert r["roofline_ms"] == pytest.approx(r["bytes_per_token"] / (r["bandwidth_GBps"] * 1e9) * 1e3)


SPEC_RUN = r"""
import json, sys
sys.modules["torch"] = None
sys.modules["triton"] = None
sys.path.insert(0, {stubs!r})
from cuda.bindings import driver as stub
from kestrel.artifacts.plan import load_plan
from kestrel.runtime.gpu import GpuStep
step = GpuStep(load_plan({plan!r}), use_graph={graph!r})
step.begin([1, 2, 3], 0.0, 1.0, 0)
n0 = len(stub.LAUNCHES)
step.run_spec_prefill(1)
step.run_spec(2)
step.dyn["pos"] = 7  # what the iterations' spec_end would have left (the stub runs no kernel)
got = step.read_spec(0, 6).wait()  # the prompt, then rows the stub left zero
print(json.dumps({{"k": step.spec_k, "launched": [name for name, *_ in stub.LAUNCHES[n0:]], "got": got,
                   "graph_launches": stub.CALLS.get("cuGraphLaunch", 0), "spec_graph": step.graph_spec_exec is not None,
                   "spec_pdl": step.spec_pdl, "spec_trial": step.spec_pdl_trial,
                   "spec_edges": sorted({{(t, port) for _, _, t, port in stub.GRAPH_EDGES.get(step.graph_spec_exec, [])}})}}))
"""


@pytest.fixture(scope="module")
def spec_plan(tmp_path_factory):
    """A random-weight tiny-mtp plan with K = 2 drafts, built once for the speculative tests."""
    path = str(tmp_path_factory.mktemp("spec") / "tiny-mtp.plan")
    r = run_cli("kestrelc", "build", "tiny-mtp", "-o", path, "--target", "sm_90", "--max-seq", "32",
                "--speculative", "mtp", "--draft-tokens", "2", "--weights", "random")
    assert r.returncode == 0, r.stderr
    return path


@pytest.mark.parametrize("graph", [True, False])
def test_gpu_runtime_runs_the_speculative_programs(spec_plan, graph):
    """A --speculative mtp plan on the GPU runtime: the head's weights are uploaded with the rest, the
    speculative prefill and iteration are packed from the launch plan, replayed as their own graphs
    (or streamed without graphs), and read_spec copies the token rows and dyn.pos back asynchronously."""
    path = spec_plan
    r = subprocess.run([sys.executable, "-c", SPEC_RUN.format(stubs=STUBS, plan=path, graph=graph)],
                       capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                            if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    lp = load_plan(path).launch_plan
    names = [k["name"] for k in lp["kernels"]]
    prefill = [names[launch["kernel_index"]] for launch in lp["speculative"]["prefill"]["launches"]]
    iteration = [names[launch["kernel_index"]] for launch in lp["speculative"]["iteration"]["launches"]]
    assert out["k"] == 2 and out["spec_graph"] == graph
    assert out["launched"] == prefill + iteration * 2  # (graph replays are recorded node by node)
    assert out["got"] == [[1, 2, 3, 0, 0, 0], 7]


@pytest.mark.parametrize("env,chained", [({"KESTREL_STUB_PDL_FACTOR": "0.9"}, True),
                                         ({"KESTREL_STUB_PDL_FACTOR": "1.1"}, False), ({"KESTREL_PDL": "1"}, True),
                                         ({"KESTREL_PDL": "0", "KESTREL_STUB_PDL_FACTOR": "0.5"}, False)])
def test_speculative_iteration_graph_keeps_programmatic_edges_when_faster(spec_plan, env, chained):
    """The iteration's graph is built with plain and with programmatic edges and timed at load as the step's is
    (the stub's clock makes the chained one 10% faster or slower; KESTREL_PDL=1 keeps it untimed, 0 never builds
    it); the graph kept runs the iterations."""
    r = subprocess.run([sys.executable, "-c", SPEC_RUN.format(stubs=STUBS, plan=spec_plan, graph=True)],
                       capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                            if k != "TRITON_INTERPRET"} | env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["spec_graph"] and out["spec_pdl"] is chained
    assert out["spec_edges"] == ([[1, 1]] if chained else [[0, 0]])
    assert (out["spec_trial"] is None) == ("KESTREL_PDL" in env)
    if out["spec_trial"]:
        assert set(out["spec_trial"]) == {"plain_ms", "programmatic_ms"}


def test_gpu_speculative_loop_refuses_a_position_that_does_not_advance(spec_plan):
    """The token loop on a speculative plan checks that each iteration advanced the position (the stub
    runs no kernel, so it does not): a clear error with its exit code, not a request that never ends."""
    path = spec_plan
    r = subprocess.run([sys.executable, "-c", RUN.format(stubs=STUBS, plan=path, extra=["--no-graph"])],
                       capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                            if k != "TRITON_INTERPRET"})
    assert r.returncode != 0 and "speculative iterations moved the position" in r.stderr, r.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KESTREL_SPEC_SAMPLING")}
    sampled = RUN.format(stubs=STUBS, plan=path, extra=["--no-graph", "--temperature", "0.5"])
    # temperature > 0 speculates by default (speculative sampling on the device): the same guard
    r = subprocess.run([sys.executable, "-c", sampled], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "speculative iterations moved the position" in r.stderr, r.stderr[-2000:]
    # with the gate off (KESTREL_SPEC_SAMPLING=0) it decodes plainly: no speculative iteration, so no such error
    r = subprocess.run([sys.executable, "-c", sampled], capture_output=True, text=True,
                       env=env | {"KESTREL_SPEC_SAMPLING": "0"})
    assert "speculative iterations moved the position" not in r.stderr, r.stderr[-2000:]


REPLAY_RUN = r"""
import json, sys
sys.modules["torch"] = None
sys.modules["triton"] = None
sys.path.insert(0, {stubs!r})
import numpy as np
from cuda.bindings import driver as stub
from kestrel.artifacts.plan import load_plan
from kestrel.runtime import bench
from kestrel.runtime.generate import Generation
from kestrel.runtime.gpu import GpuStep
plan = load_plan({plan!r})
step = GpuStep(plan, use_graph=True)
ids, seq = [1, 2, 3], [1, 2, 3] + list(range(10, 22))
step.begin(ids, 0.0, 1.0, 0)
step.set_replay(seq, 0.5)
buf = step.binding.spec_replay
image = np.zeros(buf.numel, dtype=np.int32)
step.copy_from_device(image, buf.address)
on = [step.dyn["replay"], step.dyn["replay_accept"]]
step.begin(ids, 0.0, 1.0, 0)
off = step.dyn["replay"]
calls = []
def token_loop(st, prompt, n, sampling, replay=None, **kw):
    # the stub runs no kernel, so the real loop cannot advance: this one sets what a request would, and
    # returns the replayed tokens with the acceptance the setting gives
    st.begin(prompt, sampling.temperature, sampling.top_p, sampling.seed)
    if replay is not None:
        st.set_replay(replay.tokens, replay.accept)
    calls.append(None if replay is None else [replay.accept, sampling.seed])
    g = Generation(prompt_tokens=list(prompt), tokens=seq[len(prompt):len(prompt) + n], decode_ms=2.0 * n)
    if replay is not None:
        g.draft_tokens, g.spec_iterations, g.spec_accepted = st.spec_k, 4, round(4 * replay.accept * st.spec_k)
        g.decode_ms = 1.0 * n
    return g
bench.generate = token_loop
n0 = len(stub.LAUNCHES)
r = bench.bench_controlled(plan, ids, seq, [0.0, 1.0], 3, log=lambda m: None, source="replay:run.json", step=step)
launched, first_calls = [name for name, *_ in stub.LAUNCHES[n0:]], list(calls)
# as bench/device_spec.py calls it: no plan, the launch lists given
lp = plan.launch_plan
r2 = bench.bench_controlled(None, ids, seq, [1.0], 1, log=lambda m: None, source="replay:run.json", step=step,
                            launches=lp["speculative"]["iteration"]["launches"], m1_launches=lp["launches"])
print(json.dumps({{"image": image[:len(seq) + 2].tolist(), "on": on, "off": off, "calls": first_calls, "report": r,
                   "text": bench.format_controlled(r), "launched": launched,
                   "no_plan": r2["controlled_acceptance"]["iteration"]}}))
"""


def spec_phases_of(lp):
    from kestrel.runtime.bench import spec_phases

    return spec_phases(lp["speculative"]["iteration"]["launches"])


def test_gpu_replay_upload_and_controlled_acceptance_bench(spec_plan):
    """Controlled acceptance on the GPU runtime: set_replay uploads the replayed sequence to the plan's
    replay buffer and sets dyn.replay / replay_accept, the next request's begin turns it off; the bench
    interleaves plain and replayed requests per round (seeded by the round), reports every setting under
    controlled_acceptance, and times the iteration's launches kernel by kernel split into verify /
    accept + rollback / draft, and the one-token step's, from the launch plan."""
    r = subprocess.run([sys.executable, "-c", REPLAY_RUN.format(stubs=STUBS, plan=spec_plan)],
                       capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                            if k != "TRITON_INTERPRET"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["image"] == [1, 2, 3] + list(range(10, 22)) + [0, 0]
    assert out["on"] == [1, 0.5] and out["off"] == 0
    assert out["calls"] == [c for rnd in range(4) for c in (None, [0.0, rnd], [1.0, rnd])]
    c = out["report"]["controlled_acceptance"]
    assert c["label"].startswith("controlled-acceptance") and c["draft_tokens"] == 2 and c["rounds"] == 3
    assert [row["draft_accept"] for row in c["rows"]] == [0.0, 1.0]
    assert [row["accepted_per_step"] for row in c["rows"]] == [0.0, 2.0]
    assert [row["expected_accepted_per_step"] for row in c["rows"]] == [0.0, 2.0]
    assert all(row["tokens_equal_replay"] and row["speedup_over_plain"] == 2.0 for row in c["rows"])
    lp = load_plan(spec_plan).launch_plan
    names = [k["name"] for k in lp["kernels"]]
    iteration = [names[launch["kernel_index"]] for launch in lp["speculative"]["iteration"]["launches"]]
    step = [names[launch["kernel_index"]] for launch in lp["launches"]]
    prefill = [names[launch["kernel_index"]] for launch in lp["speculative"]["prefill"]["launches"]]
    it = c["iteration"]
    n = (32 - 3 - 4 * 2 - 4) // (2 + 3)  # iterations timed: as many as fit in max_seq 32 (at most 8)
    # the speculative prefill, n iterations and n one-token steps kernel by kernel, n + 1 step graph replays,
    # n + 1 replays of the verify's launches as a graph
    verify = [k for k, p in zip(iteration, spec_phases_of(lp)) if p == "verify"]
    assert out["launched"] == prefill + iteration * n + step * n + step * (n + 1) + verify * (n + 1)
    assert it["verify_ms_graph"] > 0 and it["verify_over_m1_step_graph"] > 0 and "as graphs" in out["text"]
    assert sum(it["launches_per_phase"].values()) == len(iteration)
    assert all(it["phase_ms_kernel_by_kernel"][ph] > 0 for ph in ("verify", "accept_rollback", "draft"))
    assert it["verify_over_m1_step"] > 0 and it["m1_step_ms_graph"] is not None
    assert "controlled-acceptance" in out["text"] and "verify at K + 1 rows" in out["text"]
    # per kernel (each launch's median): the verify's launches and the one-token step's
    kernels = [launch["kernel"] for launch, p in zip(lp["speculative"]["iteration"]["launches"],
                                                      spec_phases_of(lp)) if p == "verify"]
    assert {k: n for k, (n, _) in it["verify_by_kernel"].items()} == {k: kernels.count(k) for k in set(kernels)}
    assert all(ms > 0 for _, ms in it["verify_by_kernel"].values())
    assert sum(n for n, _ in it["m1_step_by_kernel"].values()) == len(step)
    assert "verify by kernel" in out["text"] and "M=1 step by kernel" in out["text"]
    assert out["no_plan"]["m1_step_by_kernel"] == it["m1_step_by_kernel"]
    # the phases follow the ops: the row decisions and rollback between the verify's lm_head and the head
    ops = [launch["op"] for launch in lp["speculative"]["iteration"]["launches"]]
    from kestrel.runtime.bench import spec_phases
    phases = spec_phases(lp["speculative"]["iteration"]["launches"])
    assert {o for o, p in zip(ops, phases) if p == "accept_rollback"} == {"argmax_rows", "spec_filter",
                                                                        "spec_sample_rows", "accept", "gdn_commit"}
    assert ops[:2] == ["spec_begin", "replay_drafts"] and phases[:2] == ["verify", "verify"]
    assert ops.count("draft_sample") == 2 and all(p == "draft" for o, p in zip(ops, phases) if o == "draft_sample")
    assert ops.count("spec_filter") == 3  # the verified rows' (one launch) and each draft's


def test_a_plan_larger_than_the_free_memory_is_refused_at_load(plan):
    """At load the runtime compares the arena (+ LOAD_RESERVE) with the device's free memory (cuMemGetInfo)
    and stops with exit 12 and the numbers, before any allocation; with enough free memory it runs."""
    from kestrel.runtime.gpu import LOAD_RESERVE

    _, path = plan
    arena = load_plan(path).launch_plan["arena_bytes"]
    script = (f"import sys; sys.modules['torch'] = None; sys.path.insert(0, {STUBS!r}); "
              f"from kestrel.runtime.cli import main; "
              f"sys.argv = ['kestrel-run', {path!r}, '--prompt-ids', '1,2', '--max-new-tokens', '2']; main()")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for free, code in ((arena + LOAD_RESERVE - 1, 12), (arena + LOAD_RESERVE, 0)):
        r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           env=env | {"KESTREL_STUB_FREE_BYTES": str(free)})
        assert r.returncode == code, r.stderr[-2000:]
        if code:
            line = r.stderr.strip().splitlines()[-1]
            assert "needs a" in line and "GB free of 85.9 GB" in line and "--quant q4" in line, line
