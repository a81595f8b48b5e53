"""TensorRT backend, the runtime half: run engine plans. numpy + cuda.bindings + tensorrt (no torch);
the engine is built by the compiler (compiler/tensorrt_build.py).

Written against the documented TensorRT (>= 10) Python API and NOT RUN on these machines: TensorRT
cannot be installed here (tests/test_onnx.py runs the engine test only where ``import tensorrt``
works). What is checked here is the ONNX graph it builds from (onnxruntime against the CPU path).

* The engine is the plan part ENGINE_PART, with manifest keys ``backend: "tensorrt"``,
  ``tensorrt_version``, ``compute_capability``.
* ``TrtStep``: the step object of runtime/generate.py for an engine plan. At load: the TensorRT
  version and the GPU are checked against the manifest (an engine runs only on the TensorRT version
  and GPU it was built with), the engine is deserialized, every IO tensor gets a device buffer by
  name (``set_tensor_address``), each state two (ping-pong: a step reads ``<state>`` from one and
  writes ``<state>.out`` to the other; the next step swaps them). Per step, the token and pos inputs
  are device-to-device copies (from the device token sequence and a table of positions), then
  ``execute_async_v3`` — or, with ``use_graph`` (the caller passes the KESTREL_GRAPH gate,
  runtime/gpu.graph_enabled), one of two CUDA graphs captured around it at load (one per ping-pong
  parity) — then ``next_token`` is copied into the token sequence. Nothing waits for the host between steps. Greedy only (the ONNX step's argmax).
"""
from __future__ import annotations

import math

import numpy as np

from kestrel.artifacts.errors import ArtifactError, DeviceError, UnsupportedError, import_optional
from kestrel.artifacts.plan import ENGINE_PART, STATE_OUT_SUFFIX, TENSORRT_MISSING
from kestrel.runtime import cuda as kc


def import_tensorrt():
    """The tensorrt module, or BackendMissingError naming what is missing."""
    return import_optional("tensorrt", TENSORRT_MISSING)


def gpu_compute_capability(context: str) -> int:
    """Compute capability of GPU 0 as 10 * major + minor; DeviceError prefixed with ``context``."""
    try:
        dev, _ = kc.init(0)
        return kc.compute_capability(dev)
    except DeviceError as e:
        raise DeviceError(f"{context}: no usable GPU ({e.message.split('; run with')[0]})") from None


def _itemsize(trt, dtype) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        size = {trt.float32: 4, trt.float16: 2, trt.int32: 4, trt.int8: 1, trt.bool: 1}.get(dtype)
        size = size or {"BF16": 2, "INT64": 8}.get(dtype.name)
    return size


class _Dyn:
    """dict-like view of the step's per-token values. pos, n_prompt and the sampling settings live on
    the host (the runner advances pos); token is row pos of the device token sequence, sampled the
    device ``next_token`` output."""

    def __init__(self, step: "TrtStep"):
        self.step = step
        self.host = {"pos": 0, "n_prompt": 0, "temperature": 0.0, "top_p": 1.0, "seed": 0, "top_k": 0, "min_p": 0.0}

    def __contains__(self, name):
        return name in self.host or name in ("token", "sampled")

    def __iter__(self):
        return iter(list(self.host) + ["token", "sampled"])

    def __getitem__(self, name):
        s = self.step
        if name == "token":
            return int(s.read_i64(s.tokens + 8 * self.host["pos"]))
        if name == "sampled":
            return int(s.read_i64(s.buf["next_token"][0]))
        return self.host[name]

    def __setitem__(self, name, value):
        if name == "temperature" and value > 0:
            raise UnsupportedError("this plan's TensorRT engine decodes greedily (the ONNX step's argmax): use "
                                   "--temperature 0, or a plan of the kernels backend for sampling")
        if name == "token":
            self.step.write_i64(self.step.tokens + 8 * self.host["pos"], value)
            return
        if name not in self.host:
            raise KeyError(name)
        self.host[name] = value

    def update(self, **kw):
        for k, v in kw.items():
            self[k] = v


class _Tokens:
    """read_tokens' handle: tokens[lo:hi] copied back after the steps enqueued so far."""

    def __init__(self, step: "TrtStep", lo: int, hi: int):
        self.step, self.lo, self.hi = step, lo, hi

    def wait(self) -> list[int]:
        buf = np.zeros(self.hi - self.lo, dtype=np.int64)
        self.step.copy_from_device(buf, self.step.tokens + 8 * self.lo)
        return [int(t) for t in buf]


class TrtStep:
    synchronous = False
    prefill_rows = 0
    """A TensorRT engine plan as a step object (see runtime/generate.py): ``dyn``, ``reset()``,
    ``begin()``, ``run()``, ``read_tokens()``, ``mark_ms()``, ``output(name)``, ``max_seq``, ``mode``."""

    def __init__(self, plan, use_graph: bool = True, log=None):
        m = plan.manifest
        if m.get("backend") != "tensorrt":
            raise UnsupportedError("this plan has no TensorRT engine (backend kernels): run it with the GPU or CPU path")
        built = m.get("tensorrt_version")
        trt = self.trt = import_tensorrt()
        if trt.__version__ != built:
            raise ArtifactError(f"{plan.path}: its engine was built by TensorRT {built}, this machine has "
                                f"{trt.__version__}: TensorRT engines load only in the version that built them; "
                                f"rebuild with kestrelc build --backend tensorrt")
        cu = kc.driver()
        want = m["compute_capability"]
        cc = gpu_compute_capability("the TensorRT engine plan")
        if f"{cc // 10}.{cc % 10}" != want:
            raise DeviceError(f"this plan's TensorRT engine was built for compute capability {want} ({m['target']}), "
                              f"this GPU is sm_{cc}: rebuild it on this GPU with --backend tensorrt --target sm_{cc}")
        self.max_seq = m["max_seq"]
        self.stream = kc.check(cu.cuStreamCreate(0), "cuStreamCreate")
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(bytes(plan.read(ENGINE_PART)))
        if self.engine is None:
            raise ArtifactError(f"{plan.path}: TensorRT {trt.__version__} could not deserialize the engine; rebuild "
                                f"the plan with kestrelc build --backend tensorrt")
        self.context = self.engine.create_execution_context()
        # one buffer per IO tensor, two per state (ping-pong); all zeroed
        self.io: dict[str, tuple[tuple, int]] = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            shape = tuple(self.engine.get_tensor_shape(name))
            self.io[name] = (shape, math.prod(shape) * _itemsize(trt, self.engine.get_tensor_dtype(name)))
        self.states = [n for n in self.io if n + STATE_OUT_SUFFIX in self.io]
        self.allocs, self.buf = [], {}
        for name, (_, nbytes) in self.io.items():
            if name.endswith(STATE_OUT_SUFFIX) and name[:-len(STATE_OUT_SUFFIX)] in self.states:
                continue
            self.buf[name] = [self._alloc(nbytes) for _ in range(2 if name in self.states else 1)]
        for need in ("token", "pos", "next_token", "logits"):
            if need not in self.buf:
                raise ArtifactError(f"{plan.path}: the engine has no {need!r} tensor; rebuild the plan")
        self.tokens = self._alloc(8 * (self.max_seq + 1))  # the request's token sequence (int64)
        self.positions = self._alloc(8 * self.max_seq)  # 0 .. max_seq-1, the pos input's source rows
        kc.check(cu.cuMemcpyHtoD(self.positions, np.arange(self.max_seq, dtype=np.int64).ctypes.data,
                                 8 * self.max_seq), "cuMemcpyHtoD")
        self.dyn = _Dyn(self)
        self.parity = 0
        self.graphs = None
        self.graph_fallbacks = 0
        if use_graph:
            try:
                self.graphs = [self._capture(p) for p in (0, 1)]
            except DeviceError as e:
                self.graph_fallbacks = 1
                if log:
                    log(f"warning: CUDA graph capture around the TensorRT engine failed ({e}); running it "
                        f"with execute_async_v3 per step")
        self.reset()

    @property
    def mode(self) -> str:
        return "tensorrt-graph" if self.graphs else "tensorrt"

    # --- memory ------------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> int:
        cu = kc.driver()
        ptr = kc.check(cu.cuMemAlloc(max(nbytes, 256)), "cuMemAlloc")
        self.allocs.append(ptr)
        kc.check(cu.cuMemsetD8(ptr, 0, max(nbytes, 256)), "cuMemsetD8")
        return int(ptr)

    def copy_from_device(self, dst: np.ndarray, src: int) -> None:
        cu = kc.driver()
        kc.check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, self.stream), "cuMemcpyDtoHAsync")
        self.sync()

    def read_i64(self, addr: int) -> int:
        buf = np.zeros(1, dtype=np.int64)
        self.copy_from_device(buf, addr)
        return int(buf[0])

    def write_i64(self, addr: int, value: int) -> None:
        buf = np.array([value], dtype=np.int64)
        kc.check(kc.driver().cuMemcpyHtoDAsync(addr, buf.ctypes.data, 8, self.stream), "cuMemcpyHtoDAsync")
        self.sync()

    def _d2d(self, dst: int, src: int, nbytes: int) -> None:
        kc.check(kc.driver().cuMemcpyDtoDAsync(dst, src, nbytes, self.stream), "cuMemcpyDtoDAsync")

    def sync(self) -> None:
        kc.check(kc.driver().cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    # --- the engine ----------------------------------------------------------------------------
    def _bind(self, parity: int) -> None:
        """Named IO bindings for one ping-pong parity: states in from buffer p, out to buffer 1 - p."""
        for name, bufs in self.buf.items():
            if name in self.states:
                ok = self.context.set_tensor_address(name, bufs[parity]) and \
                    self.context.set_tensor_address(name + STATE_OUT_SUFFIX, bufs[1 - parity])
            else:
                ok = self.context.set_tensor_address(name, bufs[0])
            if not ok:
                raise DeviceError(f"TensorRT refused the address of tensor {name!r}")

    def _execute(self, parity: int) -> None:
        self._bind(parity)
        if not self.context.execute_async_v3(int(self.stream)):
            raise DeviceError("TensorRT execute_async_v3 failed (its log above says why)")

    def _capture(self, parity: int):
        """A CUDA graph of one engine run at this parity. The run is enqueued once first, outside the
        capture (TensorRT may do deferred work on its first enqueue), then captured."""
        cu = kc.driver()
        self._execute(parity)
        self.sync()
        kc.check(cu.cuStreamBeginCapture(self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                 "cuStreamBeginCapture")
        try:
            self._execute(parity)
        finally:
            graph = kc.check(cu.cuStreamEndCapture(self.stream), "cuStreamEndCapture")
        return kc.check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    # --- the step protocol ---------------------------------------------------------------------
    def reset(self) -> None:
        cu = kc.driver()
        self.sync()
        for name in self.states:
            for b in self.buf[name]:
                kc.check(cu.cuMemsetD8(b, 0, self.io[name][1]), "cuMemsetD8 (state)")
        kc.check(cu.cuMemsetD8(self.tokens, 0, 8 * (self.max_seq + 1)), "cuMemsetD8 (tokens)")
        self.sync()
        self.parity = 0
        self.dyn.host.update(pos=0, n_prompt=0)

    def begin(self, prompt: list[int], temperature: float, top_p: float, seed: int, start: int = 0,
              top_k: int = 0, min_p: float = 0.0) -> None:
        """A new request: zeroed states, the prompt ids in the device token sequence (``start`` > 0:
        the sequence continues, see GpuStep.begin)."""
        if start == 0:
            self.reset()
        self.dyn.update(temperature=temperature, top_p=top_p, seed=seed, top_k=top_k, min_p=min_p)
        ids = np.array(prompt[start:], dtype=np.int64)
        kc.check(kc.driver().cuMemcpyHtoD(self.tokens + 8 * start, ids.ctypes.data, ids.nbytes), "cuMemcpyHtoD")
        self.dyn.host.update(pos=start, n_prompt=len(prompt))

    def run(self, n: int = 1, marks: list | None = None) -> None:
        """Enqueue n steps; each reads token = tokens[pos] at pos and, once past the prompt, writes its
        next_token to tokens[pos + 1]. ``marks`` receives a CUDA event recorded after each step."""
        cu = kc.driver()
        for _ in range(n):
            pos = self.dyn.host["pos"]
            if pos >= self.max_seq:
                raise UnsupportedError(f"position {pos} is past the plan's max_seq {self.max_seq}")
            self._d2d(self.buf["token"][0], self.tokens + 8 * pos, 8)
            self._d2d(self.buf["pos"][0], self.positions + 8 * pos, 8)
            if self.graphs:
                kc.check(cu.cuGraphLaunch(self.graphs[self.parity], self.stream), "cuGraphLaunch")
            else:
                self._execute(self.parity)
            if pos + 1 >= self.dyn.host["n_prompt"]:
                self._d2d(self.tokens + 8 * (pos + 1), self.buf["next_token"][0], 8)
            self.parity ^= 1
            self.dyn.host["pos"] = pos + 1
            if marks is not None:
                ev = kc.check(cu.cuEventCreate(0), "cuEventCreate")
                kc.check(cu.cuEventRecord(ev, self.stream), "cuEventRecord")
                marks.append(ev)

    def read_tokens(self, lo: int, hi: int) -> _Tokens:
        return _Tokens(self, lo, hi)

    def mark_ms(self, marks: list) -> list[float]:
        cu = kc.driver()
        if marks:
            kc.check(cu.cuEventSynchronize(marks[-1]), "cuEventSynchronize")
        return [kc.check(cu.cuEventElapsedTime(a, b), "cuEventElapsedTime") for a, b in zip(marks, marks[1:])]

    def output(self, name: str) -> np.ndarray:
        """``logits`` / ``hidden`` of the last step, float32."""
        shape, nbytes = self.io[name]
        buf = np.empty(nbytes // 4, dtype=np.float32)
        self.copy_from_device(buf, self.buf[name][0])
        return buf.reshape(shape)
