"""The generated protobuf and gRPC stubs of proto/kvmesh/v1/kvmesh.proto (``kvmesh.v1``).

They are generated at build time, never committed: the CMake target ``kvmesh_python`` writes
them to ``<build>/clients/python/kvmesh/v1/``, which :mod:`kvmesh` finds on ``sys.path``
(clients/python/README.md).
"""

from __future__ import annotations

try:
    from .v1 import kvmesh_pb2 as pb
    from .v1 import kvmesh_pb2_grpc as pb_grpc
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvmesh: the generated stubs kvmesh.v1.kvmesh_pb2 / kvmesh_pb2_grpc were not found. "
        "Build them (cmake --build <build> --target kvmesh_python) and put "
        "<build>/clients/python on PYTHONPATH next to clients/python; see "
        "clients/python/README.md") from error

__all__ = ["pb", "pb_grpc"]
