// How the kernels' loops split their work between threads.  Not a static split alone: the
// two threads of a VM need not run at one speed.  On the 2-vCPU AMX Xeon this project
// measures on, one thread's AMX tile products take 7 ns or 30 ns and its AVX-512 dot
// products 0.8 ns or 1.6 ns, changing every ~0.1 s with the host's load and often one thread
// fast while the other is slow; a static split then waits for the slow one.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

// Items 0 .. n-1 between the threads: each_item(n, setup, item) runs state = setup() once per
// thread, then item(state, i) for each of its items.  Thread t owns the t-th contiguous
// range of items and takes them in order; a thread done with its own takes what is left of
// the others', one item at a time.
template <typename Setup, typename Item>
void each_item(int64_t n, Setup setup, Item item) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  struct alignas(64) Range {  // one cache line each: a thread's counter is its own until others help
    std::atomic<int64_t> next;
    int64_t end;
  };
  std::vector<Range> ranges(threads);
  for (int64_t t = 0; t < threads; ++t) ranges[t].next = t * n / threads, ranges[t].end = (t + 1) * n / threads;
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {  // one index per thread (all when nested)
    auto state = setup();
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t k = 0; k < threads; ++k) {
        Range& r = ranges[(t + k) % threads];
        for (int64_t i = r.next.fetch_add(1, std::memory_order_relaxed); i < r.end;
             i = r.next.fetch_add(1, std::memory_order_relaxed))
          item(state, i);
      }
  });
}

// at::parallel_for's contract, f(b0, b1) over [begin, end), in chunks of `chunk` indices
// shared as each_item shares items (a chunk a few KiB of weight or more: one atomic
// increment each).
template <typename F>
void parallel_chunks(int64_t begin, int64_t end, int64_t chunk, const F& f) {
  if (end <= begin) return;
  each_item((end - begin + chunk - 1) / chunk, [] { return 0; }, [&](int, int64_t i) {
    const int64_t b0 = begin + i * chunk;
    f(b0, std::min(end, b0 + chunk));
  });
}
