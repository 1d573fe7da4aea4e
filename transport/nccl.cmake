# The nccl transport (included by transport/CMakeLists.txt when KVMESH_HAVE_NCCL).
#
# NCCL is linked as the shared libnccl.so.2 that the root CMakeLists.txt found
# (KVMESH_NCCL_LIBRARY): NVIDIA ships no static NCCL with this toolkit. Binaries find it through
# their build RPATH (CMake adds the library's folder); a binary that uses this code on another
# machine needs libnccl.so.2 there (tests/gpu/run.sh points the build at the GPU machine's own).

# Communicators without gRPC: NcclComm and NcclCommPool. Built on the GPU machine too (its
# build has no gRPC) and exercised by tests/gpu/nccl_self_transfer_test.
add_library(kvmesh_nccl_comm nccl_comm.cc)
add_library(kvmesh::nccl_comm ALIAS kvmesh_nccl_comm)
target_include_directories(kvmesh_nccl_comm PUBLIC ${PROJECT_SOURCE_DIR})
target_include_directories(kvmesh_nccl_comm SYSTEM PUBLIC ${KVMESH_NCCL_INCLUDE_DIR})
target_link_libraries(kvmesh_nccl_comm
  PUBLIC kvmesh::cuda_device CUDA::cudart_static ${KVMESH_NCCL_LIBRARY} absl::status
         absl::statusor absl::time absl::strings absl::span absl::function_ref
         absl::core_headers Threads::Threads
  PRIVATE kvmesh_warnings)

# The Transport (receiver) and the PeerService's sender side over the peer API.
if(KVMESH_BUILD_GRPC)
  add_library(kvmesh_nccl_transport nccl_transport.cc)
  add_library(kvmesh::nccl_transport ALIAS kvmesh_nccl_transport)
  target_include_directories(kvmesh_nccl_transport PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(kvmesh_nccl_transport
    PUBLIC kvmesh::nccl_comm kvmesh::checksum kvmesh::proto gRPC::grpc++ absl::status
           absl::statusor absl::time
    PRIVATE absl::strings kvmesh_warnings)
endif()
