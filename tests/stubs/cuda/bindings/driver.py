"""A stand-in for ``cuda.bindings.driver`` (tests only): the driver calls Kestrel's GPU runtime makes,
answered on the host. "Device" memory is host memory (ctypes buffers), so copies and memsets really
move bytes and are bounds-checked against their allocation; kernels are recorded, not run. The
calls are counted in ``CALLS`` and every kernel launch (direct or as a graph node) in ``LAUNCHES``.
Timing: every event pair measures 0.01 ms, plus a virtual clock that graph launches advance by 1 us a
node, times KESTREL_STUB_PDL_FACTOR for a graph of programmatic edges (unset: the clock stands still), and
times KESTREL_STUB_LATE_FACTOR too for one whose kernels are not the first graph's (the late-trigger variants).
Used by tests/test_runtime_gpu_stub_driver.py to run the GPU runtime's whole load-and-generate path
with torch and triton unimportable, on any machine (with or without a GPU).
"""
import ctypes
import enum
import os
from collections import Counter


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76


class CUstreamWaitValue_flags(enum.IntEnum):
    CU_STREAM_WAIT_VALUE_GEQ = 0


CU_MEMHOSTALLOC_DEVICEMAP = 2


class CUevent_flags(enum.IntEnum):
    CU_EVENT_DEFAULT = 0
    CU_EVENT_DISABLE_TIMING = 2


class CUfunction_attribute(enum.IntEnum):
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


class CUDA_KERNEL_NODE_PARAMS:
    pass


class CUgraphDependencyType(enum.IntEnum):
    CU_GRAPH_DEPENDENCY_TYPE_DEFAULT = 0
    CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1


CU_GRAPH_KERNEL_NODE_PORT_DEFAULT = 0
CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1
CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER = 2


class CUgraphEdgeData:
    from_port = 0
    to_port = 0
    type = 0


COMPUTE_CAPABILITY = (9, 0)
SMS = 132
CALLS: Counter = Counter()
LAUNCHES: list = []  # (function name, grid, block, number of parameter cells) per launch
_buffers: dict[int, ctypes.Array] = {}  # address -> buffer (device and pinned host allocations)
_functions: dict[int, str] = {}
_graph_nodes: dict[int, list] = {}
GRAPH_EDGES: dict[int, list] = {}  # graph -> (from node, to node, dependency type, from port) per edge
OK = CUresult.CUDA_SUCCESS


def _count(fn):
    def wrapper(*args):
        CALLS[fn.__name__] += 1
        return fn(*args)
    wrapper.__name__ = fn.__name__
    return wrapper


_virtual: dict[int, int] = {}  # address -> size of allocations too large to back (the bandwidth probes' GiB)
VIRTUAL_FROM = 64 << 20
_next_virtual = [1 << 60]


def _alloc(n: int) -> int:
    if n >= VIRTUAL_FROM:  # bounds-checked, never read or written
        base = _next_virtual[0]
        _next_virtual[0] += (int(n) + 4095) // 4096 * 4096
        _virtual[base] = int(n)
        return base
    buf = ctypes.create_string_buffer(max(int(n), 1))
    _buffers[ctypes.addressof(buf)] = buf
    return ctypes.addressof(buf)


def _is_virtual(addr: int, n: int) -> bool:
    return any(base <= addr and addr + n <= base + size for base, size in _virtual.items())


def _check_range(addr: int, n: int, what: str) -> None:
    """[addr, addr + n) lies inside one allocation (device or pinned host), else the call fails."""
    if _is_virtual(addr, n):
        return
    for base, buf in _buffers.items():
        if base <= addr and addr + n <= base + len(buf):
            return
    raise AssertionError(f"{what}: [{addr:#x}, +{n}) is outside every allocation")


@_count
def cuInit(flags):
    return (OK,)


@_count
def cuDeviceGet(i):
    return (OK, 0)


@_count
def cuDevicePrimaryCtxRetain(dev):
    return (OK, 1)


@_count
def cuCtxSetCurrent(ctx):
    return (OK,)


@_count
def cuDeviceGetAttribute(attr, dev):
    major, minor = COMPUTE_CAPABILITY
    if attr == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT:
        return (OK, SMS)
    return (OK, major if attr == CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR else minor)


@_count
def cuGetErrorName(err):
    return (OK, CUresult(err).name.encode())


@_count
def cuStreamCreate(flags):
    return (OK, 7)


@_count
def cuStreamSynchronize(stream):
    return (OK,)


@_count
def cuMemAlloc(n):
    return (OK, _alloc(n))


@_count
def cuMemGetInfo():
    """(free, total): KESTREL_STUB_FREE_BYTES free of 80 GB (unset: all of it)."""
    total = 80 << 30
    return (OK, int(os.environ.get("KESTREL_STUB_FREE_BYTES", total)), total)


@_count
def cuMemAllocHost(n):
    return (OK, _alloc(n))


@_count
def cuMemHostAlloc(n, flags):
    return (OK, _alloc(n))


@_count
def cuMemHostGetDevicePointer(p, flags):
    return (OK, p)  # mapped: the same address


@_count
def cuMemFree(p):
    return (OK,)


@_count
def cuMemFreeHost(p):
    return (OK,)


@_count
def cuStreamWaitValue32(stream, addr, value, flags):
    _check_range(int(addr), 4, "cuStreamWaitValue32")
    return (OK,)


@_count
def cuMemsetD32Async(dst, value, n, stream):
    _check_range(int(dst), 4 * n, "cuMemsetD32Async")
    if not _is_virtual(int(dst), 4 * n):
        (ctypes.c_uint32 * n).from_address(int(dst))[:] = [value] * n
    return (OK,)


@_count
def cuMemsetD8(dst, value, n):
    _check_range(int(dst), n, "cuMemsetD8")
    ctypes.memset(int(dst), value, n)
    return (OK,)


@_count
def cuMemcpyHtoDAsync(dst, src, n, stream):
    _check_range(int(dst), n, "cuMemcpyHtoDAsync")
    ctypes.memmove(int(dst), int(src), n)
    return (OK,)


@_count
def cuMemcpyDtoHAsync(dst, src, n, stream):
    _check_range(int(src), n, "cuMemcpyDtoHAsync")
    ctypes.memmove(int(dst), int(src), n)
    return (OK,)


@_count
def cuMemcpyDtoDAsync(dst, src, n, stream):
    _check_range(int(src), n, "cuMemcpyDtoDAsync (source)")
    _check_range(int(dst), n, "cuMemcpyDtoDAsync (destination)")
    if not (_is_virtual(int(src), n) or _is_virtual(int(dst), n)):
        ctypes.memmove(int(dst), int(src), n)
    return (OK,)


@_count
def cuModuleLoadData(image):
    assert bytes(image[:4]) == b"\x7fELF", "not a cubin"
    return (OK, len(_functions) + 1)


@_count
def cuModuleGetFunction(module, name):
    f = 1000 + len(_functions)
    _functions[f] = name.decode()
    return (OK, f)


FUNC_ATTRIBUTES: dict = {}  # "kernel name:attribute name" -> the value last set


@_count
def cuFuncSetAttribute(f, attr, value):
    FUNC_ATTRIBUTES[f"{_functions[f]}:{CUfunction_attribute(attr).name}"] = int(value)
    return (OK,)


def _record(f, grid, block, params):
    assert all(int(g) > 0 for g in grid), f"{_functions[f]}: grid {grid}"
    LAUNCHES.append((_functions[f], tuple(int(g) for g in grid), int(block), int(params)))


@_count
def cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
    _record(f, (gx, gy, gz), bx, params)
    return (OK,)


@_count
def cuGraphCreate(flags):
    g = 100 + len(_graph_nodes)
    _graph_nodes[g] = []
    return (OK, g)


@_count
def cuGraphAddKernelNode(graph, deps, n_deps, p):
    _graph_nodes[graph].append((p.func, (p.gridDimX, p.gridDimY, p.gridDimZ), p.blockDimX, p.kernelParams))
    return (OK, len(_graph_nodes[graph]))


@_count
def cuGraphAddDependencies(graph, from_, to, edge_data, n):
    assert len(from_) == len(to) == n and (edge_data is None or len(edge_data) == n)
    for i in range(n):
        e = edge_data[i] if edge_data else CUgraphEdgeData()
        if e.type == CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC:  # the driver's rule
            assert e.from_port in (CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, CU_GRAPH_KERNEL_NODE_PORT_LAUNCH_ORDER)
        assert e.to_port == 0
        GRAPH_EDGES.setdefault(graph, []).append((int(from_[i]), int(to[i]), int(e.type), int(e.from_port)))
    return (OK,)


@_count
def cuGraphInstantiate(graph, flags):
    # the runtime's graphs are chains: node i + 1 depends on node i alone (the order the stub replays)
    edges = GRAPH_EDGES.get(graph, [])
    assert [(a, b) for a, b, _, _ in edges] == [(i, i + 1) for i in range(1, len(_graph_nodes[graph]))], edges
    return (OK, graph)


@_count
def cuGraphExecDestroy(exec_):
    assert exec_ in _graph_nodes
    return (OK,)


@_count
def cuGraphDestroy(graph):
    assert graph in _graph_nodes
    return (OK,)


@_count
def cuGraphLaunch(exec_, stream):
    factor = os.environ.get("KESTREL_STUB_PDL_FACTOR")
    if factor is not None:
        programmatic = any(t == CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
                           for _, _, t, _ in GRAPH_EDGES.get(exec_, []))
        first = _graph_nodes[min(_graph_nodes)]
        late = [f for f, *_ in _graph_nodes[exec_]] != [f for f, *_ in first]
        _clock[0] += 1e-3 * len(_graph_nodes[exec_]) * (float(factor) if programmatic else 1.0) * (
            float(os.environ.get("KESTREL_STUB_LATE_FACTOR", "1")) if late else 1.0)
    for f, grid, block, params in _graph_nodes[exec_]:
        _record(f, grid, block, params)
    return (OK,)


class _Event:
    t = 0.0


_clock = [0.0]  # ms


@_count
def cuEventCreate(flags):
    return (OK, _Event())


@_count
def cuEventRecord(ev, stream):
    ev.t = _clock[0]
    return (OK,)


@_count
def cuEventSynchronize(ev):
    return (OK,)


@_count
def cuEventElapsedTime(a, b):
    return (OK, 0.01 + b.t - a.t)


@_count
def cuEventDestroy(ev):
    return (OK,)
