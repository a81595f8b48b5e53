"""Thin CUDA driver layer for the GPU runtime: numpy + cuda.bindings, no torch.

Loads cubins, packs kernel arguments once (each argument in its own numpy scalar, plus the array
of their addresses that cuLaunchKernel and cuGraphAddKernelNode take), and launches. Every driver
error becomes a DeviceError with one line; a missing driver says so and points at --device cpu.
"""
from __future__ import annotations

import numpy as np

from kestrel.artifacts.errors import DeviceError

_NP_TYPES = {"fp32": np.float32, "i32": np.int32, "u32": np.uint32, "i64": np.int64}


class NoGpuError(DeviceError):
    """No usable GPU here: cuda.bindings is missing, or there is no CUDA driver."""


def driver():
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        raise NoGpuError("cuda.bindings is not installed (pip install cuda-bindings); or run with --device cpu")
    return cu


def check(result, what: str):
    """cuda.bindings returns (err, *values); raise on error, return the value(s)."""
    cu = driver()
    err, *values = result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise DeviceError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def init(device: int = 0):
    """Initialise the driver and make the device's primary context current; returns (device, context)."""
    cu = driver()
    try:
        check(cu.cuInit(0), "cuInit")
    except RuntimeError as e:  # no driver: cuda.bindings raises a RuntimeError subclass
        raise NoGpuError(f"no CUDA driver ({e}); run with --device cpu") from None
    dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return dev, ctx


def compute_capability(dev) -> int:
    cu = driver()
    a = cu.CUdevice_attribute
    major = check(cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attribute")
    minor = check(cu.cuDeviceGetAttribute(a.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attribute")
    return 10 * major + minor


class Kernel:
    """A loaded cubin entry point with its launch metadata."""

    def __init__(self, cubin: bytes, name: str, num_warps: int, shared: int, pdl: bool = False, carveout: int = -1):
        cu = driver()
        self.pdl = pdl  # compiled with the programmatic-dependent-launch wait (kernels/pdl.py)
        self.module = check(cu.cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        self.function = check(cu.cuModuleGetFunction(self.module, name.encode()), f"cuModuleGetFunction({name})")
        self.name, self.block, self.shared = name, 32 * num_warps, shared
        if shared > 48 * 1024:
            check(cu.cuFuncSetAttribute(self.function,
                                        cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        shared), f"cuFuncSetAttribute({name})")
        if carveout >= 0:  # the plan's preferred shared-memory carveout (kernels/targets.py, MoeRule.carveout)
            check(cu.cuFuncSetAttribute(self.function,
                                        cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                        carveout), f"cuFuncSetAttribute({name}, carveout)")


class PackedArgs:
    """Kernel arguments packed once: pointers as uint64, scalars by their Triton type, then Triton's
    two trailing scratch pointers. ``address`` is the void** cuLaunchKernel takes."""

    def __init__(self, types: list[str], values: list, scratch: tuple[int, int] = (0, 0)):
        self.cells = []
        for t, v in zip(types, values):
            dt = np.uint64 if t.startswith("*") else _NP_TYPES[t]
            self.cells.append(np.array([v], dtype=dt))
        self.cells += [np.array([s], dtype=np.uint64) for s in scratch]
        self.pointers = np.array([c.ctypes.data for c in self.cells], dtype=np.uint64)

    @property
    def address(self) -> int:
        return self.pointers.ctypes.data


def launch(kernel: Kernel, grid, args: PackedArgs, stream=0) -> None:
    cu = driver()
    check(cu.cuLaunchKernel(kernel.function, *grid, kernel.block, 1, 1, kernel.shared, stream, args.address, 0),
          f"cuLaunchKernel({kernel.name})")


def chain_graph(launches, pdl: bool):
    """The launches [(kernel, grid, args)] as one CUDA graph of kernel nodes in a chain: programmatic edges
    when ``pdl`` (each kernel then waits for its predecessor itself: kernels/pdl.py), else plain ones.
    Returns (graph, its executable)."""
    cu = driver()
    graph = check(cu.cuGraphCreate(0), "cuGraphCreate")
    if pdl:
        edge = cu.CUgraphEdgeData()
        edge.type = cu.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
        edge.from_port = cu.CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
    prev = None
    for kernel, grid, args in launches:
        p = cu.CUDA_KERNEL_NODE_PARAMS()
        p.func = kernel.function
        p.gridDimX, p.gridDimY, p.gridDimZ = grid
        p.blockDimX, p.blockDimY, p.blockDimZ = kernel.block, 1, 1
        p.sharedMemBytes = kernel.shared
        p.kernelParams = args.address
        node = check(cu.cuGraphAddKernelNode(graph, [], 0, p), "cuGraphAddKernelNode")
        if prev is not None:
            check(cu.cuGraphAddDependencies(graph, [prev], [node], [edge] if pdl else None, 1),
                  "cuGraphAddDependencies")
        prev = node
    return graph, check(cu.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
