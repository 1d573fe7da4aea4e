# NCCL (included by transport/CMakeLists.txt when KVMESH_HAVE_NCCL_API).
#
# Nothing links libnccl: kvmesh::nccl_api loads it with dlopen at run time (transport/nccl_api.h)
# and every NCCL call goes through its table, so binaries start where NCCL is missing (a
# `--backend=host` node never loads it). Only nccl.h is needed to build, with the CUDA runtime
# headers it includes.

# The loader: nccl.h and the CUDA headers, libdl. No CUDA runtime library, so it builds (and is
# tested) without CUDA too.
add_library(kvmesh_nccl_api nccl_api.cc)
add_library(kvmesh::nccl_api ALIAS kvmesh_nccl_api)
target_include_directories(kvmesh_nccl_api PUBLIC ${PROJECT_SOURCE_DIR})
target_include_directories(kvmesh_nccl_api SYSTEM PUBLIC ${KVMESH_NCCL_INCLUDE_DIR}
                           ${KVMESH_CUDA_RUNTIME_INCLUDE_DIR})
target_link_libraries(kvmesh_nccl_api
  PUBLIC absl::status absl::statusor ${CMAKE_DL_LIBS}
  PRIVATE absl::strings kvmesh_warnings)

if(NOT KVMESH_HAVE_NCCL)
  return()
endif()

# Communicators without gRPC: NcclComm and NcclCommPool. Built on the GPU machine too (its
# build has no gRPC) and exercised by tests/gpu/nccl_self_transfer_test.
add_library(kvmesh_nccl_comm nccl_comm.cc)
add_library(kvmesh::nccl_comm ALIAS kvmesh_nccl_comm)
target_include_directories(kvmesh_nccl_comm PUBLIC ${PROJECT_SOURCE_DIR})
target_link_libraries(kvmesh_nccl_comm
  PUBLIC kvmesh::nccl_api kvmesh::cuda_device ${KVMESH_CUDART} absl::status absl::statusor
         absl::time absl::strings absl::span absl::function_ref absl::core_headers
         Threads::Threads
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
