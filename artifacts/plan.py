"""The .plan artifact: the one contract between compiler and runtime (format version: FORMAT_VERSION).

A plan is a single file (see README, "Artifact layout"), a safetensors container holding
  * the weights, one tensor per program weight, under the program's names;
  * ``__kestrel__/program``: the step program in its text form (UTF-8 bytes);
  * ``__kestrel__/program_prefill``: the M-row step (``prefill_rows`` rows a replay) in its text form,
    sharing the step program's weights, states and dyn slots, when the manifest's prefill_rows > 0;
  * ``__kestrel__/program_spec_prefill`` and ``__kestrel__/program_spec``: the speculative prefill and
    iteration (``kestrelc build --speculative mtp``; the manifest's ``speculative`` says the method and
    the drafts an iteration), sharing the arena of the programs above;
  * ``__kestrel__/tokenizer``: a tokenizers ``tokenizer.json`` (UTF-8 bytes), when the model has one;
  * ``__kestrel__/launch_plan``: the launch plan (JSON; compiler/launch_plan.py says every key), the
    GPU runtime's only input: arena regions, dyn slot table, weight placements (or the launches that
    fill random weights), output and token-sequence placements, the bytes a step moves, the kernel
    table (per compiled kernel: cubin part, entry name, parameters in order with types, num_warps,
    shared memory, scratch sizes, compiler and exact arch), and every launch with its kernel index,
    grid, warps, constexprs and arguments as arena offsets or constants;
  * ``__kestrel__/tensorrt_engine``: a TensorRT engine (``--backend tensorrt`` plans, which have no
    launch plan), its ONNX inputs ``<state>`` fed back from outputs ``<state>.out``;
  * ``__kestrel__/cubin/NNN``: the cubins (GPU targets);
and, in the header metadata,
  * ``kestrel.manifest``: JSON with the format and producer versions, target, quantization, max_seq,
    the model config, where it came from, and the sha256, dtype and shape of every part;
  * ``kestrel.manifest_sha256``: the sha256 of that JSON string, so an edited manifest is caught.

``load_plan`` checks all of it before anything runs; weight checksums are checked as each weight
is read (``Plan.read``), so a run reads every byte once.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import metadata

from kestrel.artifacts.container import Container, StreamWriter
from kestrel.artifacts.errors import ArtifactError

FORMAT = "kestrel.plan"
# 2: the step feeds itself from a device token sequence (state "tokens", dyn n_prompt)
# 3: the launch plan carries everything the runtime needs (regions, weights, outputs, tokens, fill, step bytes)
# 4: sampling in one many-program launch (top-k / min-p)
# 5: the speculative verify keeps each row's Gated DeltaNet update (recurrent_rows) and gdn_commit applies the kept
#    ones, where gdn_rows_snap kept state snapshots and gdn_rollback copied one back (stop 39)
FORMAT_VERSION = 5
PROGRAM_PART = "__kestrel__/program"
TOKENIZER_PART = "__kestrel__/tokenizer"
LAUNCH_PLAN_PART = "__kestrel__/launch_plan"
PREFILL_PROGRAM_PART = "__kestrel__/program_prefill"  # the M-row step (manifest prefill_rows > 0)
# the speculative prefill and iteration (manifest "speculative": {"method": "mtp", "draft_tokens": K})
SPEC_PREFILL_PROGRAM_PART = "__kestrel__/program_spec_prefill"
SPEC_PROGRAM_PART = "__kestrel__/program_spec"
ENGINE_PART = "__kestrel__/tensorrt_engine"
STATE_OUT_SUFFIX = ".out"  # an engine's state <name> is fed back from its output <name>.out
TENSORRT_MISSING = "TensorRT is not installed here (`import tensorrt`: {error})"


def producer_version() -> str:
    try:
        return f"kestrel {metadata.version('kestrel')}"
    except metadata.PackageNotFoundError:
        return "kestrel (not installed)"


@dataclass
class PlanInfo:
    """What the manifest says besides the parts: filled by the compiler, read by the runtime."""

    target: str
    quant: str
    max_seq: int
    model: dict
    source: dict
    tokenizer: dict = field(default_factory=dict)  # {"eos_token_ids": [...]} when a tokenizer is stored
    weights: dict = field(default_factory=lambda: {"kind": "checkpoint"})  # or {"kind": "random", "seed": s}
    extra: dict = field(default_factory=dict)  # further manifest keys, e.g. an engine plan's backend fields


def write_plan(path: str, info: PlanInfo, program_text: str, weights: list[tuple[str, str, tuple]],
               produce_weight, tokenizer_json: str | None = None, launch_plan: dict | None = None,
               extra_parts: dict[str, bytes] | None = None, progress=None) -> None:
    """Write a plan, streaming weights one at a time.

    ``weights``: (name, dtype, shape) in the order to store them. ``produce_weight(name)`` returns
    that weight's raw little-endian bytes; it is called once per weight, in order, so only one
    weight need be in memory. ``progress(name, nbytes)`` is called after each weight.
    """
    program_bytes = program_text.encode()
    extra = [(PROGRAM_PART, program_bytes)]
    if tokenizer_json is not None:
        extra.append((TOKENIZER_PART, tokenizer_json.encode()))
    if launch_plan is not None:
        extra.append((LAUNCH_PLAN_PART, json.dumps(launch_plan, sort_keys=True).encode()))
    extra += sorted((extra_parts or {}).items())
    entries = [(n, "u8", (len(b),)) for n, b in extra] + [(n, d, tuple(s)) for n, d, s in weights]

    def metadata_fn(checksums: dict[str, str]) -> dict[str, str]:
        manifest = {
            **info.extra,
            "format": FORMAT, "format_version": FORMAT_VERSION, "producer": producer_version(),
            "target": info.target, "quant": info.quant, "max_seq": info.max_seq,
            "model": info.model, "source": info.source, "tokenizer": info.tokenizer, "weights": info.weights,
            "parts": {n: {"dtype": d, "shape": list(s), "sha256": checksums[n]} for n, d, s in entries},
        }
        text = json.dumps(manifest, sort_keys=True)
        return {"kestrel.manifest": text, "kestrel.manifest_sha256": hashlib.sha256(text.encode()).hexdigest()}

    w = StreamWriter(path, entries, metadata_fn)
    try:
        for name, data in extra:
            w.write(name, data)
        for name, _, _ in weights:
            data = produce_weight(name)
            w.write(name, data)
            if progress is not None:
                progress(name, memoryview(data).nbytes)
        w.close()
    except BaseException:
        w.abort()
        raise


class Plan:
    """A loaded, validated plan. ``program_text``, ``tokenizer_json``, ``manifest`` are checked;
    ``read(name)`` returns a weight's bytes after checking its sha256."""

    def __init__(self, path: str):
        self.path = path
        self.container = c = Container(path)
        text = c.metadata.get("kestrel.manifest")
        if text is None:
            raise ArtifactError(f"{path} is a safetensors file but not a Kestrel plan (no manifest)")
        if hashlib.sha256(text.encode()).hexdigest() != c.metadata.get("kestrel.manifest_sha256"):
            raise ArtifactError(f"{path}: the manifest was altered (checksum mismatch); rebuild the plan")
        try:
            m = json.loads(text)
        except json.JSONDecodeError:
            raise ArtifactError(f"{path}: the manifest is not valid JSON; rebuild the plan") from None
        if m.get("format") != FORMAT:
            raise ArtifactError(f"{path}: not a Kestrel plan (format {m.get('format')!r})")
        if m.get("format_version") != FORMAT_VERSION:
            raise ArtifactError(f"{path} has plan format version {m.get('format_version')!r} (made by "
                                f"{m.get('producer')}); this Kestrel reads version {FORMAT_VERSION}: rebuild it "
                                f"with `kestrelc build`")
        self.manifest = m
        # the manifest holds every part's sha256: its own hash identifies the plan's whole content
        self.content_sha256 = c.metadata["kestrel.manifest_sha256"]
        parts = m.get("parts", {})
        if set(parts) != set(c.tensors):
            missing = sorted(set(parts) - set(c.tensors))
            extra = sorted(set(c.tensors) - set(parts))
            raise ArtifactError(f"{path}: parts do not match the manifest (missing {missing[:3]}, "
                                f"unlisted {extra[:3]}); the file is corrupted")
        for name, p in parts.items():
            dtype, shape = c.tensors[name][:2]
            if p["dtype"] != dtype or tuple(p["shape"]) != shape:
                raise ArtifactError(f"{path}: part {name!r} is {dtype}{list(shape)} but the manifest says "
                                    f"{p['dtype']}{p['shape']}; the file is corrupted")
        if PROGRAM_PART not in parts:
            raise ArtifactError(f"{path}: no step program inside; the file is corrupted")
        self.program_text = bytes(self.read(PROGRAM_PART)).decode()
        self.tokenizer_json = bytes(self.read(TOKENIZER_PART)).decode() if TOKENIZER_PART in parts else None
        self.launch_plan = json.loads(bytes(self.read(LAUNCH_PLAN_PART))) if LAUNCH_PLAN_PART in parts else None
        self.prefill_rows = int(m.get("prefill_rows", 0))
        self.prefill_program_text = (bytes(self.read(PREFILL_PROGRAM_PART)).decode()
                                     if self.prefill_rows and PREFILL_PROGRAM_PART in parts else None)
        if self.prefill_rows and self.prefill_program_text is None:
            raise ArtifactError(f"{path}: the manifest promises an M-row step but the plan holds none; the file is "
                                f"corrupted")
        self.speculative = m.get("speculative")  # {"method": "mtp", "draft_tokens": K} or None
        self.spec_programs = None  # (prefill text, iteration text)
        if self.speculative is not None:
            if SPEC_PREFILL_PROGRAM_PART not in parts or SPEC_PROGRAM_PART not in parts:
                raise ArtifactError(f"{path}: the manifest promises speculative programs but the plan holds none; "
                                    f"the file is corrupted")
            self.spec_programs = (bytes(self.read(SPEC_PREFILL_PROGRAM_PART)).decode(),
                                  bytes(self.read(SPEC_PROGRAM_PART)).decode())

    def cubin(self, part: str) -> bytes:
        return bytes(self.read(part))

    @property
    def random_weights(self) -> dict | None:
        """{"kind": "random", "seed": s, ...} for a benchmarking plan that stores no weights."""
        w = self.manifest.get("weights", {"kind": "checkpoint"})
        return w if w.get("kind") == "random" else None

    @property
    def backend(self) -> str:
        """``kernels`` (launch plan + cubins, or the CPU path), or ``tensorrt`` (an engine part)."""
        return self.manifest.get("backend", "kernels")

    @property
    def weight_names(self) -> list[str]:
        return [n for n in self.manifest["parts"] if not n.startswith("__kestrel__/")]

    def read(self, name: str) -> memoryview:
        raw = self.container.raw(name)
        if hashlib.sha256(raw).hexdigest() != self.manifest["parts"][name]["sha256"]:
            raise ArtifactError(f"{self.path}: part {name!r} fails its checksum; the file was altered or "
                                f"damaged: rebuild or re-copy it")
        return raw

    def verify_all(self) -> int:
        """Check every part's checksum; returns the number of bytes checked."""
        return sum(self.read(n).nbytes for n in self.manifest["parts"])

    def close(self) -> None:
        self.container.close()


def load_plan(path: str) -> Plan:
    return Plan(path)
