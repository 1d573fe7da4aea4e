// The grpc.health.v1 client under the names kvmeshctl and its helpers have always used; the
// client itself is kvmesh::HealthClient (service/health_client.h, part of kvmesh::service since
// cluster membership checks peers with it).
#ifndef KVMESH_SERVICE_CTL_HEALTH_H_
#define KVMESH_SERVICE_CTL_HEALTH_H_

#include "service/health_client.h"

namespace kvmesh {
namespace ctl {

using ::kvmesh::HealthClient;
using ::kvmesh::ServingStatus;
using ::kvmesh::ServingStatusName;

}  // namespace ctl
}  // namespace kvmesh

#endif  // KVMESH_SERVICE_CTL_HEALTH_H_
