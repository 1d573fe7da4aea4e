// RunIndex: an ordered map from position to cell, stored as runs. Positions p, p+1, ..., p+n-1
// held in cells c, c+1, ..., c+n-1 are one entry, so a sequence appended in one piece, and every
// prefix copied from it, is a handful of entries whatever its length: copying, cutting or
// dropping a range costs per run, not per position. (The caller still visits the cells of what
// it copies or drops, for their reference counts; that is a loop over consecutive integers.)
//
// Runs are kept maximal: no two entries could be joined into one. Positions and cells are
// int32; the last position may be INT32_MAX, so range ends are int64 throughout.
//
// Thread safety: none; a const RunIndex may be read from several threads.
#ifndef KVMESH_CACHE_RUN_INDEX_H_
#define KVMESH_CACHE_RUN_INDEX_H_

#include <cstdint>
#include <limits>
#include <optional>

#include "absl/container/btree_map.h"

namespace kvmesh {

class RunIndex {
 public:
  // Positions [pos, pos + length) in cells [cell, cell + length).
  struct Run {
    int32_t pos;
    int32_t cell;
    int32_t length;
  };
  static constexpr int64_t kBegin = std::numeric_limits<int64_t>::min();
  static constexpr int64_t kEnd = std::numeric_limits<int64_t>::max();

 private:
  struct Span {
    int32_t cell;
    int32_t length;
  };
  using Map = absl::btree_map<int32_t, Span>;  // first position -> its run

 public:
  // Visits every stored position in order.
  class const_iterator {
   public:
    int32_t pos() const { return run_->first + offset_; }
    int32_t cell() const { return run_->second.cell + offset_; }
    const_iterator& operator++() {
      if (++offset_ == run_->second.length) {
        ++run_;
        offset_ = 0;
      }
      return *this;
    }
    bool operator==(const const_iterator& other) const {
      return run_ == other.run_ && offset_ == other.offset_;
    }
    bool operator!=(const const_iterator& other) const { return !(*this == other); }

   private:
    friend class RunIndex;
    const_iterator(Map::const_iterator run, int32_t offset) : run_(run), offset_(offset) {}
    Map::const_iterator run_;
    int32_t offset_;
  };

  bool empty() const { return runs_.empty(); }
  int64_t size() const { return size_; }  // stored positions
  size_t run_count() const { return runs_.size(); }
  // The lowest and highest stored positions; the index must not be empty.
  int32_t first() const { return runs_.begin()->first; }
  int32_t last() const;

  const_iterator begin() const { return const_iterator(runs_.begin(), 0); }
  const_iterator end() const { return const_iterator(runs_.end(), 0); }
  // The first stored position >= pos.
  const_iterator lower_bound(int64_t pos) const;
  bool contains(int64_t pos) const { return Find(pos).has_value(); }
  // The cell of pos, if stored.
  std::optional<int32_t> Find(int64_t pos) const;
  // The highest stored position <= pos, if any.
  std::optional<int32_t> LastAtOrBelow(int64_t pos) const;

  // Stores pos in cell, joining it to the runs beside it where it continues them. Returns false
  // (and changes nothing) when pos is stored already. Appending past last() costs O(1) amortized
  // plus a lookup.
  bool Insert(int32_t pos, int32_t cell);
  // Drops the stored positions in [begin, end); returns how many there were.
  int64_t Erase(int64_t begin, int64_t end);
  // A copy holding the stored positions below end.
  RunIndex Prefix(int64_t end) const;

  // Calls f(const Run&) for the runs of the positions in [begin, end), in order, each cut to the
  // range.
  template <typename F>
  void ForEachRun(int64_t begin, int64_t end, F&& f) const {
    for (auto it = FirstRunEndingAfter(begin); it != runs_.end() && it->first < end; ++it) {
      int64_t pos = it->first, cell = it->second.cell, stop = pos + it->second.length;
      if (pos < begin) {
        cell += begin - pos;
        pos = begin;
      }
      if (stop > end) stop = end;
      f(Run{static_cast<int32_t>(pos), static_cast<int32_t>(cell),
            static_cast<int32_t>(stop - pos)});
    }
  }

 private:
  static int64_t Stop(Map::const_iterator it) { return int64_t{it->first} + it->second.length; }
  // The run holding pos, or else the first run after it (of runs, const or not).
  template <typename M>
  static auto FirstRunEndingAfter(M& runs, int64_t pos) -> decltype(runs.begin());
  Map::const_iterator FirstRunEndingAfter(int64_t pos) const;

  Map runs_;
  int64_t size_ = 0;
};

}  // namespace kvmesh

#endif  // KVMESH_CACHE_RUN_INDEX_H_
