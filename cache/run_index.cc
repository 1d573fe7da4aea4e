#include "cache/run_index.h"

#include <algorithm>
#include <iterator>

namespace kvmesh {
namespace {

// A key no smaller than any stored position below pos and no greater than any at or above it.
int32_t ClampKey(int64_t pos) {
  return static_cast<int32_t>(std::clamp<int64_t>(pos, std::numeric_limits<int32_t>::min(),
                                                  std::numeric_limits<int32_t>::max()));
}

}  // namespace

int32_t RunIndex::last() const {
  auto it = std::prev(runs_.end());
  return static_cast<int32_t>(Stop(it) - 1);
}

template <typename M>
auto RunIndex::FirstRunEndingAfter(M& runs, int64_t pos) -> decltype(runs.begin()) {
  if (pos > std::numeric_limits<int32_t>::max()) return runs.end();
  auto it = runs.upper_bound(ClampKey(pos));  // the first run starting after pos
  if (it != runs.begin()) {
    auto prev = std::prev(it);
    if (int64_t{prev->first} + prev->second.length > pos) return prev;
  }
  return it;
}

RunIndex::Map::const_iterator RunIndex::FirstRunEndingAfter(int64_t pos) const {
  return FirstRunEndingAfter(runs_, pos);
}

RunIndex::const_iterator RunIndex::lower_bound(int64_t pos) const {
  auto it = FirstRunEndingAfter(pos);
  if (it == runs_.end() || it->first >= pos) return const_iterator(it, 0);
  return const_iterator(it, static_cast<int32_t>(pos - it->first));
}

std::optional<int32_t> RunIndex::Find(int64_t pos) const {
  auto it = FirstRunEndingAfter(pos);
  if (it == runs_.end() || it->first > pos) return std::nullopt;
  return static_cast<int32_t>(it->second.cell + (pos - it->first));
}

std::optional<int32_t> RunIndex::LastAtOrBelow(int64_t pos) const {
  if (pos < std::numeric_limits<int32_t>::min()) return std::nullopt;
  auto it = runs_.upper_bound(ClampKey(pos));
  if (it == runs_.begin()) return std::nullopt;
  --it;
  return static_cast<int32_t>(std::min(pos, Stop(it) - 1));
}

bool RunIndex::Insert(int32_t pos, int32_t cell) {
  // The first run starting after pos; for an append past the end, no lookup is needed.
  auto next = !runs_.empty() && pos > runs_.rbegin()->first ? runs_.end() : runs_.upper_bound(pos);
  const bool joins_next = next != runs_.end() && int64_t{next->first} == int64_t{pos} + 1 &&
                          int64_t{next->second.cell} == int64_t{cell} + 1;
  if (next != runs_.begin()) {
    auto prev = std::prev(next);
    const int64_t stop = Stop(prev);
    if (stop > pos) return false;  // stored already
    if (stop == pos && int64_t{prev->second.cell} + prev->second.length == cell) {
      ++prev->second.length;
      if (joins_next) {
        prev->second.length += next->second.length;
        runs_.erase(next);
      }
      ++size_;
      return true;
    }
  }
  if (joins_next) {
    const Span joined{cell, next->second.length + 1};
    next = runs_.erase(next);
    runs_.emplace_hint(next, pos, joined);
  } else {
    runs_.emplace_hint(next, pos, Span{cell, 1});
  }
  ++size_;
  return true;
}

int64_t RunIndex::Erase(int64_t begin, int64_t end) {
  if (begin >= end) return 0;
  Map::iterator it = FirstRunEndingAfter(runs_, begin);
  if (it == runs_.end() || it->first >= end) return 0;
  int64_t removed = 0;
  if (it->first < begin) {  // keep the head of the run that begin cuts
    const int64_t pos = it->first, stop = Stop(it);
    Map::iterator run = it;
    run->second.length = static_cast<int32_t>(begin - pos);
    if (stop > end) {  // and its tail past end: the range lies inside this run
      const Span tail{static_cast<int32_t>(run->second.cell + (end - pos)),
                      static_cast<int32_t>(stop - end)};
      runs_.emplace_hint(std::next(run), static_cast<int32_t>(end), tail);
      size_ -= end - begin;
      return end - begin;
    }
    removed += stop - begin;
    it = std::next(run);
  }
  while (it != runs_.end() && Stop(it) <= end) {
    removed += it->second.length;
    it = runs_.erase(it);
  }
  if (it != runs_.end() && it->first < end) {  // keep the tail of the run that end cuts
    const int64_t cut = end - it->first;
    const Span tail{static_cast<int32_t>(it->second.cell + cut),
                    static_cast<int32_t>(it->second.length - cut)};
    it = runs_.erase(it);
    runs_.emplace_hint(it, static_cast<int32_t>(end), tail);
    removed += cut;
  }
  size_ -= removed;
  return removed;
}

RunIndex RunIndex::Prefix(int64_t end) const {
  if (empty() || Stop(std::prev(runs_.end())) <= end) return *this;
  RunIndex out;
  // Runs are copied in order, each appended at the end of the copy's tree.
  ForEachRun(kBegin, end, [&out](const Run& run) {
    out.runs_.emplace_hint(out.runs_.end(), run.pos, Span{run.cell, run.length});
    out.size_ += run.length;
  });
  return out;
}

}  // namespace kvmesh
