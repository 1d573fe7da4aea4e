// The node's Prometheus metrics (docs/operate.md#metrics lists every series), through
// prometheus-cpp (Debian's prometheus-cpp-dev).
//
// Two kinds of series. Events (RPCs handled, bytes transferred, migrations, drains) are counted
// and timed where they happen, through the methods below. State (cells used, sequences, device
// memory, leases, queue depths) is read when Prometheus scrapes: collectors registered with
// AddCollector run on the scraping thread and report what is there now, so a deleted cache
// leaves no stale series behind.
//
// Labels are bounded: method and service names, gRPC code names, transports, peers (members of
// the cluster), tenants, caches and their groups. Never sequence ids, snapshot ids or positions.
//
// Thread safety: thread-safe; collectors must be too (they run on the exposer's threads).
#ifndef KVMESH_SERVICE_COMMON_METRICS_H_
#define KVMESH_SERVICE_COMMON_METRICS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "cache/mutex.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/metric_family.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}

namespace kvmesh {

// Families a collector fills at scrape time.
class ScrapeSink {
 public:
  explicit ScrapeSink(std::vector<prometheus::MetricFamily>* out) : out_(out) {}
  // Starts a family; Add appends to the last one started.
  void Gauge(const std::string& name, const std::string& help);
  void Counter(const std::string& name, const std::string& help);
  void Add(const std::map<std::string, std::string>& labels, double value);

 private:
  std::vector<prometheus::MetricFamily>* const out_;
};

class Metrics {
 public:
  using Collector = std::function<void(ScrapeSink&)>;

  Metrics();
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // Serves /metrics on `address` ("host:port") until destroyed. INVALID_ARGUMENT/UNAVAILABLE
  // when it cannot listen there; the bound port in *port (port 0 picks one).
  absl::Status Serve(const std::string& address, int* port);
  // Stops serving (before what the collectors read goes away). Idempotent.
  void StopServing();

  void AddCollector(Collector collect);

  // ---- RPCs: the node's server interceptor -----------------------------------------------
  // Per method, found once per call.
  class Rpc {
   public:
    void Started() { in_flight_->Increment(); }
    void Finished(absl::string_view code, absl::Duration elapsed);

   private:
    friend class Metrics;
    Metrics* metrics_ = nullptr;
    std::string service_;
    std::string method_;
    prometheus::Gauge* in_flight_ = nullptr;
    prometheus::Histogram* seconds_ = nullptr;
    Mutex mu_;
    std::map<std::string, prometheus::Counter*, std::less<>> handled_ ABSL_GUARDED_BY(mu_);
  };
  // The series of `service`/`method` ("CacheService", "Append"), created on first use.
  Rpc* ForRpc(absl::string_view service, absl::string_view method);

  // ---- cluster ---------------------------------------------------------------------------
  // One payload transfer between this node and `peer`: `direction` "send" or "receive", `code`
  // a gRPC code name (OK when it arrived whole); DATA_LOSS counts as a checksum failure.
  void Transfer(absl::string_view transport, absl::string_view peer, absl::string_view direction,
                absl::string_view code, uint64_t bytes, absl::Duration elapsed);
  // A sequence or snapshot migration ended: `kind` "sequence"/"snapshot", `role`
  // "source"/"target".
  void Migration(absl::string_view kind, absl::string_view role, absl::string_view code);
  // A drain ended: `result` "complete", "partial" (something stayed) or "failed".
  void Drain(absl::string_view result, int64_t sequences_moved, int64_t snapshots_moved);

 private:
  class ScrapeCollectable;

  prometheus::Counter& Count(prometheus::Family<prometheus::Counter>& family,
                             const std::map<std::string, std::string>& labels);

  const std::shared_ptr<prometheus::Registry> registry_;
  const std::shared_ptr<ScrapeCollectable> scrape_;
  std::unique_ptr<prometheus::Exposer> exposer_;

  prometheus::Family<prometheus::Counter>& rpc_handled_;
  prometheus::Family<prometheus::Histogram>& rpc_seconds_;
  prometheus::Family<prometheus::Gauge>& rpc_in_flight_;
  prometheus::Family<prometheus::Counter>& transfer_bytes_;
  prometheus::Family<prometheus::Counter>& transfers_;
  prometheus::Family<prometheus::Histogram>& transfer_seconds_;
  prometheus::Family<prometheus::Counter>& checksum_failures_;
  prometheus::Family<prometheus::Counter>& migrations_;
  prometheus::Family<prometheus::Counter>& drains_;
  prometheus::Family<prometheus::Counter>& drain_moved_;

  Mutex mu_;
  std::map<std::string, std::unique_ptr<Rpc>, std::less<>> rpcs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvmesh

#endif  // KVMESH_SERVICE_COMMON_METRICS_H_
