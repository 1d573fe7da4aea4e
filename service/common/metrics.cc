#include "service/common/metrics.h"

#include <exception>
#include <utility>

#include "absl/strings/str_cat.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"

namespace kvmesh {
namespace {

// RPCs: from a cached lookup (tens of microseconds) to a long transfer or drain.
const prometheus::Histogram::BucketBoundaries& RpcBuckets() {
  static const auto* const b = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
      0.25,   0.5,     1,      2.5,   5,      10,    30,   60,    120};
  return *b;
}

// Transfers: a small prefix over loopback to a multi-GiB sequence over a slow link.
const prometheus::Histogram::BucketBoundaries& TransferBuckets() {
  static const auto* const b = new prometheus::Histogram::BucketBoundaries{
      0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120};
  return *b;
}

}  // namespace

void ScrapeSink::Gauge(const std::string& name, const std::string& help) {
  out_->push_back(prometheus::MetricFamily{name, help, prometheus::MetricType::Gauge, {}});
}

void ScrapeSink::Counter(const std::string& name, const std::string& help) {
  out_->push_back(prometheus::MetricFamily{name, help, prometheus::MetricType::Counter, {}});
}

void ScrapeSink::Add(const std::map<std::string, std::string>& labels, double value) {
  prometheus::MetricFamily& family = out_->back();
  prometheus::ClientMetric metric;
  for (const auto& [name, v] : labels) metric.label.push_back({name, v});
  if (family.type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
}

// Runs the collectors at every scrape.
class Metrics::ScrapeCollectable final : public prometheus::Collectable {
 public:
  void Add(Collector collect) {
    MutexLock lock(&mu_);
    collectors_.push_back(std::move(collect));
  }

  std::vector<prometheus::MetricFamily> Collect() const override {
    std::vector<prometheus::MetricFamily> families;
    ScrapeSink sink(&families);
    ReaderMutexLock lock(&mu_);
    for (const Collector& collect : collectors_) collect(sink);
    return families;
  }

 private:
  mutable Mutex mu_;
  std::vector<Collector> collectors_ ABSL_GUARDED_BY(mu_);
};

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      scrape_(std::make_shared<ScrapeCollectable>()),
      rpc_handled_(prometheus::BuildCounter()
                       .Name("kvmesh_rpc_handled_total")
                       .Help("RPCs completed, by service, method and gRPC status code")
                       .Register(*registry_)),
      rpc_seconds_(prometheus::BuildHistogram()
                       .Name("kvmesh_rpc_handling_seconds")
                       .Help("Time from an RPC's start to its status, by service and method")
                       .Register(*registry_)),
      rpc_in_flight_(prometheus::BuildGauge()
                         .Name("kvmesh_rpc_in_flight")
                         .Help("RPCs started and not finished, by service and method")
                         .Register(*registry_)),
      transfer_bytes_(prometheus::BuildCounter()
                          .Name("kvmesh_transfer_bytes_total")
                          .Help("Payload bytes of completed transfers, by transport, peer and "
                                "direction (send, receive)")
                          .Register(*registry_)),
      transfers_(prometheus::BuildCounter()
                     .Name("kvmesh_transfers_total")
                     .Help("Payload transfers ended, by transport, peer, direction and gRPC "
                           "status code")
                     .Register(*registry_)),
      transfer_seconds_(prometheus::BuildHistogram()
                            .Name("kvmesh_transfer_duration_seconds")
                            .Help("Duration of payload transfers, by transport, peer and "
                                  "direction")
                            .Register(*registry_)),
      checksum_failures_(prometheus::BuildCounter()
                             .Name("kvmesh_transfer_checksum_failures_total")
                             .Help("Transfers whose payload failed its CRC-32C (DATA_LOSS)")
                             .Register(*registry_)),
      migrations_(prometheus::BuildCounter()
                      .Name("kvmesh_migrations_total")
                      .Help("Migrations ended, by kind (sequence, snapshot), this node's role "
                            "(source, target) and gRPC status code")
                      .Register(*registry_)),
      drains_(prometheus::BuildCounter()
                  .Name("kvmesh_drains_total")
                  .Help("Drains ended, by result: complete, partial (something stayed), failed")
                  .Register(*registry_)),
      drain_moved_(prometheus::BuildCounter()
                       .Name("kvmesh_drain_moved_total")
                       .Help("Sequences and snapshots that drains moved to peers, by kind")
                       .Register(*registry_)) {}

Metrics::~Metrics() = default;

absl::Status Metrics::Serve(const std::string& address, int* port) {
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(address, 2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve /metrics on ", address, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(scrape_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  *port = ports.empty() ? 0 : ports.front();
  return absl::OkStatus();
}

void Metrics::StopServing() { exposer_.reset(); }

void Metrics::AddCollector(Collector collect) { scrape_->Add(std::move(collect)); }

Metrics::Rpc* Metrics::ForRpc(absl::string_view service, absl::string_view method) {
  const std::string key = absl::StrCat(service, "/", method);
  MutexLock lock(&mu_);
  auto it = rpcs_.find(key);
  if (it != rpcs_.end()) return it->second.get();
  auto rpc = std::make_unique<Rpc>();
  rpc->metrics_ = this;
  rpc->service_ = std::string(service);
  rpc->method_ = std::string(method);
  const std::map<std::string, std::string> labels = {{"service", rpc->service_},
                                                     {"method", rpc->method_}};
  rpc->in_flight_ = &rpc_in_flight_.Add(labels);
  rpc->seconds_ = &rpc_seconds_.Add(labels, RpcBuckets());
  Rpc* const result = rpc.get();
  rpcs_.emplace(key, std::move(rpc));
  return result;
}

void Metrics::Rpc::Finished(absl::string_view code, absl::Duration elapsed) {
  in_flight_->Decrement();
  seconds_->Observe(absl::ToDoubleSeconds(elapsed));
  prometheus::Counter* counter;
  {
    MutexLock lock(&mu_);
    auto it = handled_.find(code);
    if (it == handled_.end()) {
      counter = &metrics_->rpc_handled_.Add(
          {{"service", service_}, {"method", method_}, {"code", std::string(code)}});
      handled_.emplace(std::string(code), counter);
    } else {
      counter = it->second;
    }
  }
  counter->Increment();
}

prometheus::Counter& Metrics::Count(prometheus::Family<prometheus::Counter>& family,
                                    const std::map<std::string, std::string>& labels) {
  return family.Add(labels);
}

void Metrics::Transfer(absl::string_view transport, absl::string_view peer,
                       absl::string_view direction, absl::string_view code, uint64_t bytes,
                       absl::Duration elapsed) {
  const std::map<std::string, std::string> where = {{"transport", std::string(transport)},
                                                    {"peer", std::string(peer)},
                                                    {"direction", std::string(direction)}};
  std::map<std::string, std::string> with_code = where;
  with_code.emplace("code", std::string(code));
  Count(transfers_, with_code).Increment();
  if (code == "OK") Count(transfer_bytes_, where).Increment(static_cast<double>(bytes));
  if (code == "DATA_LOSS") {
    Count(checksum_failures_, {{"transport", std::string(transport)}, {"peer", std::string(peer)}})
        .Increment();
  }
  transfer_seconds_.Add(where, TransferBuckets()).Observe(absl::ToDoubleSeconds(elapsed));
}

void Metrics::Migration(absl::string_view kind, absl::string_view role, absl::string_view code) {
  Count(migrations_,
        {{"kind", std::string(kind)}, {"role", std::string(role)}, {"code", std::string(code)}})
      .Increment();
}

void Metrics::Drain(absl::string_view result, int64_t sequences_moved, int64_t snapshots_moved) {
  Count(drains_, {{"result", std::string(result)}}).Increment();
  Count(drain_moved_, {{"kind", "sequence"}}).Increment(static_cast<double>(sequences_moved));
  Count(drain_moved_, {{"kind", "snapshot"}}).Increment(static_cast<double>(snapshots_moved));
}

}  // namespace kvmesh
