"""The local data path (docs/api.md#local-data-path): a worker on the same machine as a node maps
a cache's memory and reads pinned cells in place, as numpy arrays, instead of copying K/V
through gRPC.

    with kvmesh.local.Session("/run/kvmesh/local.sock", token=...) as session:
        cache = session.attach("m")               # maps every group's memory
        pin = session.pin("m", seq=0)              # the sequence's cells, pinned
        k0 = cache.rows(group=0, plane=0)[pin.cells[0]]   # [tokens, row bytes] of layer 0's K
        session.unpin(pin)

        plan = session.begin_append("m", kvmesh.tokens(0, range(10, 12)))
        cache.rows(0, 0)[plan.cells[0]] = ...    # every plane's rows of the two tokens
        session.commit_append(plan)

``cache.rows(g, p)`` is a writable uint8 view ``[cells, row_bytes]`` of plane ``p`` of group
``g`` (planes in payload order: docs/api.md#payload-layout); ``cache.rows(g, p, dtype)`` views
the same bytes as ``[cells, row_bytes / itemsize]`` of that numpy dtype, and ``cache.tensor(g,
p)`` as a torch tensor of the cache's dtype (bfloat16 included). The views stay valid while the
MappedCache is open (after the session too).

Framing and messages: proto/kvmesh/v1/local.proto (generated as ``kvmesh.v1.local_pb2``).
"""

from __future__ import annotations

import mmap
import socket
import struct
from dataclasses import dataclass
from typing import List, Optional

import grpc
import numpy as np

from .errors import error_for_code

try:
    from .v1 import local_pb2 as _pb
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("kvmesh.local: the generated kvmesh.v1.local_pb2 was not found; build the "
                      "kvmesh_python target (clients/python/README.md)") from error

__all__ = ["Session", "MappedCache", "MappedGroup", "Pin", "AppendPlan"]

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_MAX_FDS = 64


def _raise_for(response) -> None:
    if response.code == 0:
        return
    code = _CODES.get(response.code, grpc.StatusCode.UNKNOWN)
    raise error_for_code(code)(response.message, code=code, method="local")


@dataclass
class MappedGroup:
    """One group's memory: ``cells`` rows of every plane (offset, row_bytes). Host memory is
    ``memory`` (an mmap); GPU memory (``device`` >= 0) is at ``device_pointer`` on that CUDA
    device, imported through the driver (``memory`` is None)."""

    memory: Optional[mmap.mmap]
    cells: int
    planes: List[tuple]
    device: int = -1
    device_pointer: int = 0
    bytes: int = 0
    _driver: Optional["_CudaDriver"] = None


class _CudaDriver:
    """The CUDA driver functions that import a node's GPU memory (docs/api.md, "Local data
    path"): libcuda.so.1, or the library KVMESH_CUDA_DRIVER names (the simulated GPU of the
    tests, tests/testing/cudasim/, whose device memory is host memory this process can read)."""

    _loaded: Optional["_CudaDriver"] = None

    def __init__(self) -> None:
        import ctypes
        import os

        self.ct = ctypes
        name = os.environ.get("KVMESH_CUDA_DRIVER", "libcuda.so.1")
        self.lib = ctypes.CDLL(name)
        # The simulator's device pointers are addresses of this process.
        self.host_accessible = hasattr(self.lib, "_ZN7cudasim6ActiveEv")
        self._check(self.lib.cuInit(0), "cuInit")

    @classmethod
    def get(cls) -> "_CudaDriver":
        if cls._loaded is None:
            cls._loaded = cls()
        return cls._loaded

    def _check(self, result: int, call: str) -> None:
        if result != 0:
            code = grpc.StatusCode.INTERNAL
            raise error_for_code(code)(f"{call} failed with CUresult {result}", code=code,
                                       method="local")

    def import_memory(self, fd: int, size: int, device: int) -> int:
        """Maps the descriptor's memory read-write for ``device``; its device pointer."""
        ct = self.ct
        handle = ct.c_ulonglong(0)
        self._check(self.lib.cuMemImportFromShareableHandle(
            ct.byref(handle), ct.c_void_p(fd), ct.c_int(1)), "cuMemImportFromShareableHandle")
        pointer = ct.c_ulonglong(0)
        reserved = mapped = False
        try:
            self._check(self.lib.cuMemAddressReserve(
                ct.byref(pointer), ct.c_size_t(size), ct.c_size_t(0), ct.c_ulonglong(0),
                ct.c_ulonglong(0)), "cuMemAddressReserve")
            reserved = True
            self._check(self.lib.cuMemMap(pointer, ct.c_size_t(size), ct.c_size_t(0), handle,
                                          ct.c_ulonglong(0)), "cuMemMap")
            mapped = True

            class Location(ct.Structure):
                _fields_ = [("type", ct.c_int), ("id", ct.c_int)]

            class AccessDesc(ct.Structure):
                _fields_ = [("location", Location), ("flags", ct.c_int)]

            # CU_MEM_LOCATION_TYPE_DEVICE = 1, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
            access = AccessDesc(Location(1, device), 3)
            self._check(self.lib.cuMemSetAccess(pointer, ct.c_size_t(size), ct.byref(access),
                                                ct.c_size_t(1)), "cuMemSetAccess")
        except Exception:
            # Nothing of a failed import stays mapped (a mapping keeps the node's memory).
            if mapped:
                self.lib.cuMemUnmap(pointer, ct.c_size_t(size))
            if reserved:
                self.lib.cuMemAddressFree(pointer, ct.c_size_t(size))
            raise
        finally:
            self.lib.cuMemRelease(handle)  # the mapping keeps the memory
        return pointer.value

    def unmap(self, pointer: int, size: int) -> None:
        ct = self.ct
        self.lib.cuMemUnmap(ct.c_ulonglong(pointer), ct.c_size_t(size))
        self.lib.cuMemAddressFree(ct.c_ulonglong(pointer), ct.c_size_t(size))


def _map_group(fd: int, memory) -> MappedGroup:
    """Maps (host) or imports (GPU) a LocalGroupMemory sent with descriptor ``fd``."""
    planes = [(p.offset, p.row_bytes) for p in memory.planes]
    if memory.kind == _pb.LOCAL_MEMORY_CUDA:
        driver = _CudaDriver.get()
        pointer = driver.import_memory(fd, memory.bytes, memory.device)
        return MappedGroup(None, memory.cells, planes, memory.device, pointer, memory.bytes,
                           driver)
    # Every page mapped now (as the C++ client): no fault in a read or write later.
    mapped = mmap.mmap(fd, memory.bytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       mmap.PROT_READ | mmap.PROT_WRITE)
    return MappedGroup(mapped, memory.cells, planes, bytes=memory.bytes)


class MappedCache:
    """A cache's memory mapped into this process (``Session.attach``), or a plan's staging
    memory (``AppendPlan.staging``: None for a group without)."""

    def __init__(self, spec, groups: List[Optional[MappedGroup]]) -> None:
        self.spec = spec  # kvmesh.v1.CacheSpec
        self.groups = groups

    def rows(self, group: int, plane: int, dtype=np.uint8) -> np.ndarray:
        """Plane ``plane`` of group ``group`` as a writable ``[cells, row elements]`` view. GPU
        memory has no host view (FailedPrecondition) but on the simulated GPU; use
        ``device_pointer`` (or a CUDA build of torch) there."""
        g = self.groups[group]
        offset, row_bytes = g.planes[plane]
        if g.memory is None:
            if g._driver is None or not g._driver.host_accessible:
                code = grpc.StatusCode.FAILED_PRECONDITION
                raise error_for_code(code)(
                    f"group {group} is memory of CUDA device {g.device}: no host view of it "
                    f"(its rows start at device pointer {g.device_pointer:#x})", code=code,
                    method="local")
            ct = g._driver.ct
            buffer = (ct.c_uint8 * g.bytes).from_address(g.device_pointer)
            flat = np.frombuffer(buffer, dtype=np.uint8, count=g.cells * row_bytes,
                                 offset=offset)
        else:
            flat = np.frombuffer(g.memory, dtype=np.uint8, count=g.cells * row_bytes,
                                 offset=offset)
        dtype = np.dtype(dtype)
        return flat.view(dtype).reshape(g.cells, row_bytes // dtype.itemsize)

    def tensor(self, group: int, plane: int, dtype=None):
        """Plane ``plane`` of group ``group`` as a writable torch tensor ``[cells, row
        elements]`` over the same memory (no copy). ``dtype``: a torch dtype of 4 or 2 bytes
        (None: the cache's, ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``).
        Indexing it with a pin's or a plan's cells reads or writes those cells in place."""
        import torch  # only callers of tensor() need torch

        if dtype is None:
            if self.spec is None:
                raise ValueError("a plan's staging memory of a cache this session did not "
                                 "attach has no known dtype: pass dtype")
            dtype = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}[self.spec.dtype]
        size = torch.empty((), dtype=dtype).element_size()
        if size not in (2, 4):
            raise ValueError(f"tensor() views rows as a 2- or 4-byte dtype, not {dtype}")
        # numpy has no bfloat16: view the bytes as an integer of the same size, then retype.
        carrier = self.rows(group, plane, np.int32 if size == 4 else np.int16)
        return torch.from_numpy(carrier).view(dtype)

    def close(self) -> None:
        """Unmaps the memory (views made by ``rows`` or ``tensor`` must be gone first)."""
        for g in self.groups:
            if g is None:
                continue
            if g.memory is not None:
                g.memory.close()
            elif g._driver is not None:
                g._driver.unmap(g.device_pointer, g.bytes)
        self.groups = []

    def __enter__(self) -> "MappedCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class AppendPlan:
    """Where an Append's tokens go: per group, the cell of each token in batch order (-1: a token
    a later one of the batch overwrites; write nothing for it). A Recurrent group's plain batch
    has one cell per sequence instead (in order of first appearance): the state slot its state
    after the batch goes to. Where ``staging`` is not None and ``staging.groups[g]`` is, group
    g's cells are rows of that staging memory (a speculative batch of a Rotating or Recurrent
    group: the tokens' pending rows), not of the cache's: write them with
    ``staging.rows(g, p)`` or ``staging.tensor(g, p)``, and ``close()`` the plan once its views
    are gone (after commit or abandon)."""

    id: int
    cells: List[np.ndarray]
    expires: float  # unix seconds
    staging: Optional[MappedCache] = None

    def close(self) -> None:
        """Unmaps the staging memory (views of it must be gone first)."""
        if self.staging is not None:
            self.staging.close()
            self.staging = None


@dataclass
class Pin:
    """Cells pinned for reading: per group, the positions held and the cell of each; with
    ``queries``, per group and query the pinned positions it attends to, as (first, last)
    ranges (both included)."""

    id: int
    positions: List[np.ndarray]
    cells: List[np.ndarray]
    expires: float  # unix seconds
    visible: List[List[List[tuple]]] = None


class Session:
    """A session with a node's --local-socket, authenticated with ``token`` (empty in
    development mode) and, for an admin, the ``tenant`` to act for."""

    def __init__(self, path: str, token: str = "", tenant: str = "",
                 timeout: Optional[float] = 30.0) -> None:
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.settimeout(timeout)
        self._next_id = 1
        self._specs: dict = {}  # cache name -> its spec, from attach (a plan's staging dtype)
        try:
            self._socket.connect(path)
        except OSError as error:
            self._socket.close()
            code = grpc.StatusCode.UNAVAILABLE
            raise error_for_code(code)(f"cannot connect to {path}: {error}", code=code,
                                       method="local") from error
        request = _pb.LocalRequest()
        request.hello.token = token
        request.hello.tenant = tenant
        try:
            response, _ = self._call(request)
        except Exception:
            self._socket.close()
            raise
        self.tenant = response.hello.tenant
        self.node = response.hello.node

    def close(self) -> None:
        """Ends the session: the node drops its pins."""
        self._socket.close()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _recv_exactly(self, n: int, fds: List[int]) -> bytes:
        chunks = []
        while n > 0:
            data, ancdata, _, _ = self._socket.recvmsg(
                n, socket.CMSG_SPACE(_MAX_FDS * struct.calcsize("i")))
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(payload) - len(payload) % struct.calcsize("i")
                    fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
            if not data:
                for fd in fds:
                    socket.close(fd)
                code = grpc.StatusCode.UNAVAILABLE
                raise error_for_code(code)("the node closed the local session", code=code,
                                           method="local")
            chunks.append(data)
            n -= len(data)
        return b"".join(chunks)

    def _call(self, request):
        request.id = self._next_id
        self._next_id += 1
        body = request.SerializeToString()
        try:
            self._socket.sendall(struct.pack("<I", len(body)) + body)
        except OSError:
            pass  # a node that refused the session may have answered already: read it
        fds: List[int] = []
        (length,) = struct.unpack("<I", self._recv_exactly(4, fds))
        response = _pb.LocalResponse()
        response.ParseFromString(self._recv_exactly(length, fds))
        try:
            _raise_for(response)
        except Exception:
            for fd in fds:
                socket.close(fd)
            raise
        return response, fds

    def attach(self, cache: str) -> MappedCache:
        """Maps every group of the session tenant's cache ``cache``."""
        request = _pb.LocalRequest()
        request.attach.cache = cache
        response, fds = self._call(request)
        groups: List[MappedGroup] = []
        try:
            if len(fds) != len(response.attach.groups):
                raise RuntimeError(f"the node sent {len(fds)} descriptors for "
                                   f"{len(response.attach.groups)} groups")
            for fd, memory in zip(fds, response.attach.groups):
                groups.append(_map_group(fd, memory))
        except BaseException:
            MappedCache(response.attach.spec, groups).close()  # what was mapped before
            raise
        finally:
            for fd in fds:
                socket.close(fd)  # the mappings keep the memory
        self._specs[cache] = response.attach.spec
        return MappedCache(response.attach.spec, groups)

    def pin(self, cache: str, seq: int, begin: int = 0, end: Optional[int] = None,
            lease: Optional[float] = None, queries=None) -> Pin:
        """Pins the cells of positions [begin, end) of ``seq`` (``end`` None: to its end) for
        ``lease`` seconds (None: the node's default). ``queries``: positions of queries of
        ``seq`` (a batch's); ``Pin.visible`` then says what each attends to among the pinned
        positions, seen at the same moment (the batch's mask over what is stored)."""
        request = _pb.LocalRequest()
        request.pin.cache = cache
        request.pin.seq = seq
        request.pin.begin = begin
        if end is not None:
            request.pin.end = end
            request.pin.has_end = True
        request.pin.lease_ms = 0 if lease is None else int(round(lease * 1000))
        if queries is not None:
            request.pin.queries.extend(int(q) for q in queries)
        response, _ = self._call(request)
        result = response.pin
        return Pin(result.pin,
                   [np.array(g.positions, dtype=np.int32) for g in result.groups],
                   [np.array(g.cells, dtype=np.int64) for g in result.groups],
                   result.expires_unix_ms / 1000.0,
                   [[list(zip(v.first, v.last)) for v in g.visible] for g in result.groups])

    def begin_append(self, cache: str, tokens, token_ids=None, *, speculative: bool = False,
                     lease: Optional[float] = None) -> AppendPlan:
        """Takes cells for an Append of ``tokens`` ((seq, pos) pairs, as ``kvmesh.tokens``)
        whose rows the caller then writes in place (every plane of every group) before
        ``commit_append``; ``abandon_append``, the lease or the session's end gives them back."""
        request = _pb.LocalRequest()
        begin = request.begin_append
        begin.cache = cache
        for seq, pos in tokens:
            begin.seqs.append(int(seq))
            begin.positions.append(int(pos))
        if token_ids is not None:
            begin.token_ids.extend(int(i) for i in token_ids)
        begin.speculative = speculative
        begin.lease_ms = 0 if lease is None else int(round(lease * 1000))
        response, fds = self._call(request)
        result = response.begin_append
        staging: List[Optional[MappedGroup]] = []
        try:
            remaining = list(fds)
            for g in result.groups:
                if not g.HasField("staging"):
                    staging.append(None)
                    continue
                if not remaining:
                    raise RuntimeError("the node sent fewer descriptors than staging groups")
                staging.append(_map_group(remaining.pop(0), g.staging))
        except BaseException:
            MappedCache(None, staging).close()
            self.abandon_append(result.plan)  # give the plan's rows back now
            raise
        finally:
            for fd in fds:
                socket.close(fd)  # the mappings keep the memory
        mapped = MappedCache(self._specs.get(cache), staging) if any(staging) else None
        return AppendPlan(result.plan, [np.array(g.cells, dtype=np.int64) for g in result.groups],
                          result.expires_unix_ms / 1000.0, mapped)

    def commit_append(self, plan) -> None:
        """Makes the plan's Append happen (Append's checks, judged now)."""
        request = _pb.LocalRequest()
        request.commit_append.plan = plan.id if isinstance(plan, AppendPlan) else int(plan)
        self._call(request)

    def abandon_append(self, plan) -> None:
        """Gives the plan's cells back; nothing changes."""
        request = _pb.LocalRequest()
        request.abandon_append.plan = plan.id if isinstance(plan, AppendPlan) else int(plan)
        self._call(request)

    def unpin(self, pin) -> None:
        """Releases ``pin`` (a Pin or its id)."""
        request = _pb.LocalRequest()
        request.unpin.pin = pin.id if isinstance(pin, Pin) else int(pin)
        self._call(request)
