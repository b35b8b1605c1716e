// The lines of other data a GEMM call fetches into L2 while it computes, for whatever
// runs after it: gemm.cpp's kvloom_gemm_bf16_side takes one, decoder_stack.cpp builds
// them (the next layer's KV blocks, fetched during the matmuls before its attention).
//
// Why: a decode step's attention reads each sequence's KV from memory, and one core's
// misses in flight bound that read (docs/benchmarks.md, the tenth session). When the
// batch is split into two walks, each walk's matmuls run on one core, bound by its
// arithmetic, and leave memory bandwidth spare: the KV fetched then is read by the
// attention from cache. A fetch changes no arithmetic.
#pragma once
#include <cstdint>

namespace kvloom_side {

// Lines [first, last) of `spans`, spans of span_lines 64-byte lines each, in order:
// line i is spans[i / span_lines] + 64 * (i % span_lines). `spans` holds one more
// entry than the lines reach (any readable address): a cursor that has fetched a
// span's last line moves to the next entry before it knows whether it needs it.
struct SideStream {
  const char* const* spans;
  int64_t span_lines;
  int64_t first, last;
};

}  // namespace kvloom_side
