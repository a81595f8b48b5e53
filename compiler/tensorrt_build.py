"""TensorRT backend, the compiler half: an engine built from the ONNX step (compiler/onnx_export.py).

Written against the documented TensorRT (>= 10) Python API and NOT RUN on these machines: TensorRT
cannot be installed here. ``trt.Builder`` + ``trt.OnnxParser`` on the ONNX step, a strongly typed
network (the precision is the graph's: bf16 weights cast to fp32, q4 codes dequantised to fp32 by the graph's
blocked DequantizeLinear, fp32 math; TF32 off; TensorRT
10.12 deprecates and 11 removes the BF16/FP16 builder flags), fixed shapes, then
``builder.build_serialized_network``. compiler/build.py stores the bytes as the plan part
ENGINE_PART; runtime/tensorrt.py runs them.
"""
from __future__ import annotations

import time

from kestrel.artifacts.errors import DeviceError, UnsupportedError, import_optional
from kestrel.artifacts.plan import TENSORRT_MISSING

WORKSPACE_BYTES = 1 << 30


def import_tensorrt():
    return import_optional("tensorrt", TENSORRT_MISSING)


def gpu_compute_capability(context: str) -> int:
    """Compute capability (10 * major + minor) of GPU 0, which TensorRT builds for; DeviceError
    prefixed with ``context`` where there is none."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        raise DeviceError(f"{context}: no usable GPU (cuda-bindings is not installed)") from None
    try:
        err, = cu.cuInit(0)
    except RuntimeError as e:  # no driver: cuda.bindings raises a RuntimeError subclass
        raise DeviceError(f"{context}: no usable GPU (no CUDA driver: {e})") from None
    attr = cu.CUdevice_attribute
    err2, dev = cu.cuDeviceGet(0)
    if err != cu.CUresult.CUDA_SUCCESS or err2 != cu.CUresult.CUDA_SUCCESS:
        raise DeviceError(f"{context}: no usable GPU (cuInit / cuDeviceGet failed)")
    _, major = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
    _, minor = cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
    return 10 * major + minor


def build_engine(onnx_path: str, log=print, workspace_bytes: int = WORKSPACE_BYTES) -> tuple[bytes, str]:
    """Parse the ONNX step (external data is found next to it) and build a serialized engine for this GPU.
    Returns (engine bytes, TensorRT version)."""
    trt = import_tensorrt()
    version = trt.__version__
    flags = getattr(trt, "NetworkDefinitionCreationFlag", None)
    if flags is None or not hasattr(flags, "STRONGLY_TYPED"):
        raise UnsupportedError(f"TensorRT {version} has no strongly typed networks: TensorRT >= 10 is needed")
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(flags.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(onnx_path):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise UnsupportedError(f"TensorRT {version} could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if hasattr(trt.BuilderFlag, "TF32"):
        config.clear_flag(trt.BuilderFlag.TF32)  # fp32 matmuls stay fp32, as in Kestrel's kernels
    log(f"tensorrt: building the engine from {onnx_path} (TensorRT {version}, strongly typed, fixed shapes)")
    t0 = time.perf_counter()
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise DeviceError(f"TensorRT {version} failed to build an engine from {onnx_path} (its log above says why)")
    log(f"tensorrt: engine built in {time.perf_counter() - t0:.1f} s")
    return bytes(serialized), version
