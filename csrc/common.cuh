// Device helpers shared by the csrc kernels: peer addressing, bounded waits, last-block tickets,
// warp copies. Protocol and memory layout: moe_comm/kernels/low_latency.py and
// moe_comm/workspace.py (the Triton kernels are the specification; these kernels mirror them).
#pragma once

#include <cstdint>

#include <cuda/atomic>
#include <cuda_fp16.h>
#include <nvshmem.h>
#include <nvshmemx.h>

namespace moe_comm {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;  // threads per block of every csrc kernel
constexpr int kWarps = kThreads / kWarpSize;

// Element types of rows, as passed by moe_comm/csrc_kernels.py (DTYPE_CODES).
enum DType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2, kF64 = 3 };

__host__ __device__ constexpr int dtype_bytes(int32_t dtype) {
  return dtype == kF64 ? 8 : (dtype == kF32 ? 4 : 2);
}

// ---------------------------------------------------------------------------------------------
// Ticket words (ll_state[4..7]). The Triton kernels count their programs in the low bits and the
// program that draws `count % grid == grid - 1` publishes; that needs the word to be a multiple of
// the Triton grid when a launch starts. The CUDA blocks therefore count in bits 40..50 (and the
// blocks that gave up after a timeout in bits 51..62), and the last block subtracts what the launch
// added, so the low bits never change and a Buffer may switch implementation on every call.
constexpr int kTicketShift = 40;
constexpr int kFailShift = 51;
constexpr unsigned long long kTicketMask = (1ull << (kFailShift - kTicketShift)) - 1;  // 2047
constexpr unsigned long long kFailMask = (1ull << (63 - kFailShift)) - 1;
constexpr int kMaxGrid = static_cast<int>(kTicketMask);  // blocks per launch, at most

using SysAtomicU64 = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;
using SysAtomicI64 = cuda::atomic_ref<int64_t, cuda::thread_scope_system>;

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ int64_t load_acquire(const int64_t* word) {
  return SysAtomicI64(*const_cast<int64_t*>(word)).load(cuda::memory_order_acquire);
}

__device__ __forceinline__ void store_release(int64_t* word, int64_t value) {
  SysAtomicI64(*word).store(value, cuda::memory_order_release);
}

// ---------------------------------------------------------------------------------------------
// Peers. `peer_ptrs[d]` is the address of rank d's segment as this GPU reaches it by load/store,
// 0 where it cannot: then the kernels use NVSHMEM on the *symmetric* address, which is this rank's
// own segment (`peer_ptrs[me]`) plus the same offset, and PE `pes[d]` (or d when pes is null).
struct Peers {
  const int64_t* ptrs;
  const int32_t* pes;
  int32_t me;

  __device__ __forceinline__ char* local() const { return reinterpret_cast<char*>(ptrs[me]); }
  __device__ __forceinline__ char* direct(int d) const { return reinterpret_cast<char*>(ptrs[d]); }
  __device__ __forceinline__ int pe(int d) const { return pes != nullptr ? pes[d] : d; }
};

// True in every thread when some rank is reachable only through NVSHMEM (block-collective).
__device__ __forceinline__ bool block_any_remote(const int64_t* peer_ptrs, int R) {
  bool remote = false;
  for (int d = threadIdx.x; d < R; d += blockDim.x) remote |= peer_ptrs[d] == 0;
  return __syncthreads_or(remote) != 0;
}

// Stores `value` into the int64 word at byte `offset` of rank d's segment with release order:
// a system-scope store where rank d is reachable by load/store, an NVSHMEM signal (SET) otherwise.
__device__ __forceinline__ void publish_word(const Peers& peers, int d, int64_t offset,
                                             int64_t value) {
  char* direct = peers.direct(d);
  if (direct != nullptr) {
    store_release(reinterpret_cast<int64_t*>(direct + offset), value);
  } else {
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(peers.local() + offset),
                       static_cast<uint64_t>(value), NVSHMEM_SIGNAL_SET, peers.pe(d));
  }
}

// ---------------------------------------------------------------------------------------------
// A part of the error record: int64[4] (device memory or host-mapped pinned memory) that the first
// writer claims (word 0 reads -1 while it is being written), fills with (a, b, c), then flags 1.
inline __device__ __noinline__ void record_once(int64_t* part, int64_t a, int64_t b,
                                                int64_t c) {
  if (part == nullptr) return;
  auto* claim = reinterpret_cast<unsigned long long*>(part);
  if (atomicCAS(claim, 0ull, ~0ull) != 0ull) return;  // an earlier error is already recorded
  volatile int64_t* record = part;
  record[1] = a;
  record[2] = b;
  record[3] = c;
  __threadfence_system();
  record[0] = 1;
  __threadfence_system();
}

// Bounded waits. On timeout the first waiter to give up writes (1, peer, expected, observed) into
// the record `err` and the kernel stops doing work instead of hanging.
inline __device__ void record_timeout(int64_t* err, int peer, int64_t expected,
                                      int64_t observed) {
  record_once(err, peer, expected, observed);
}

// A dispatch's count word: pairs in the low kSlotBits bits, the call descriptor above them
// (moe_comm.call_descriptor; kernels.comm.SLOT_BITS). A receive that finds a source's descriptor
// unlike its own writes (1, kCallDiffers, source, theirs | mine << 16 | epoch << 32) into the
// int64[4] input part of the record, `part` (null: none), once; the host raises it.
constexpr int kSlotBits = 18;
constexpr int64_t kSlotMask = (1ll << kSlotBits) - 1;
constexpr int64_t kCallDiffers = 4;
constexpr int kRefusedBit = 11;  // of a descriptor: the call was refused (it sends no rows)
inline __device__ void record_call_differs(int64_t* part, int source, int64_t theirs,
                                           int64_t mine, int64_t epoch) {
  record_once(part, kCallDiffers, source, theirs | (mine << 16) | (epoch << 32));
}

// Spins until `(word >> shift) >= expected` (acquire); false after `timeout_ns`.
__device__ __forceinline__ bool wait_at_least(const int64_t* word, int shift, int64_t expected,
                                              int peer, int64_t timeout_ns, int64_t* err) {
  const uint64_t start = globaltimer_ns();
  while (true) {
    const int64_t observed =
        static_cast<int64_t>(static_cast<uint64_t>(load_acquire(word)) >> shift);
    if (observed >= expected) return true;
    if (static_cast<int64_t>(globaltimer_ns() - start) > timeout_ns) {
      record_timeout(err, peer, expected, observed);
      return false;
    }
  }
}

// Block-collective: waits for n int64 words `stride_bytes` apart, word i written by rank i.
// True in every thread when all arrived; acquire ordering extends to the whole block.
__device__ __forceinline__ bool block_wait_all(const char* words, int64_t stride_bytes, int n,
                                               int shift, int64_t expected, int64_t timeout_ns,
                                               int64_t* err) {
  bool ok = true;
  for (int i = threadIdx.x; i < n && ok; i += blockDim.x) {
    ok = wait_at_least(reinterpret_cast<const int64_t*>(words + i * stride_bytes), shift,
                       expected, i, timeout_ns, err);
  }
  const bool failed = __syncthreads_or(!ok) != 0;
  __threadfence();
  return !failed;
}

// ---------------------------------------------------------------------------------------------
// Last block of a launch (block-collective, called once by every block after its work). Returns
// true in the block that finished last; it has observed every other block's stores (each block
// fences and the ticket is acq_rel at system scope). *any_failed: some block gave up on a wait.
__device__ __forceinline__ bool draw_last_block(int64_t* ticket_word, bool failed,
                                                bool* any_failed) {
  __shared__ int s_last, s_failed;
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    SysAtomicU64 ticket(*reinterpret_cast<unsigned long long*>(ticket_word));
    const unsigned long long add =
        (1ull << kTicketShift) + (failed ? 1ull << kFailShift : 0ull);
    const unsigned long long old = ticket.fetch_add(add, cuda::memory_order_acq_rel);
    const unsigned long long drawn = (old >> kTicketShift) & kTicketMask;
    const unsigned long long fails = ((old >> kFailShift) & kFailMask) + (failed ? 1 : 0);
    s_last = drawn == gridDim.x - 1;
    s_failed = fails != 0;
    if (s_last) {  // every block has drawn: give the word back its low bits only
      ticket.fetch_sub((static_cast<unsigned long long>(gridDim.x) << kTicketShift) +
                           (fails << kFailShift),
                       cuda::memory_order_relaxed);
    }
  }
  __syncthreads();
  __threadfence();
  *any_failed = s_failed != 0;
  return s_last != 0;
}

// Adds each thread's byte counts to stats[i0], stats[i0 + 1] (block-collective).
__device__ __forceinline__ void block_add_stats(int64_t* stats, int i0, int64_t to_peers,
                                                int64_t to_self) {
  __shared__ unsigned long long s_sum[2];
  if (threadIdx.x == 0) s_sum[0] = s_sum[1] = 0;
  __syncthreads();
  if (to_peers) atomicAdd(&s_sum[0], static_cast<unsigned long long>(to_peers));
  if (to_self) atomicAdd(&s_sum[1], static_cast<unsigned long long>(to_self));
  __syncthreads();
  if (threadIdx.x == 0) {
    if (s_sum[0]) atomicAdd(reinterpret_cast<unsigned long long*>(stats + i0), s_sum[0]);
    if (s_sum[1]) atomicAdd(reinterpret_cast<unsigned long long*>(stats + i0 + 1), s_sum[1]);
  }
}

// ---------------------------------------------------------------------------------------------
// Warp copies of nbytes, in the widest unit that the addresses and the size allow, kInFlight
// units per lane loaded before any is stored (a warp keeps 32 x 4 x 16 = 2 KB of a row in
// flight, a block of 8 warps 16 KB: a 7 KB FP8 row is four round trips of its warp, a 14 KB
// bf16 row seven, where one unit at a time took 15 and 28).
constexpr int kInFlight = 4;

template <typename U>
__device__ __forceinline__ void warp_copy_units(char* dst, const char* src, int64_t nbytes,
                                                int lane) {
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(U));
  const U* s = reinterpret_cast<const U*>(src);
  U* d = reinterpret_cast<U*>(dst);
  for (int64_t base = lane; base < n; base += static_cast<int64_t>(kWarpSize) * kInFlight) {
    U v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kWarpSize;
      if (i < n) v[u] = s[i];
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kWarpSize;
      if (i < n) d[i] = v[u];
    }
  }
}

__device__ __forceinline__ void warp_copy(char* dst, const char* src, int64_t nbytes, int lane) {
  const uint64_t a = reinterpret_cast<uint64_t>(dst) | reinterpret_cast<uint64_t>(src) |
                     static_cast<uint64_t>(nbytes);
  if (a % 16 == 0) {
    warp_copy_units<uint4>(dst, src, nbytes, lane);
  } else if (a % 4 == 0) {
    warp_copy_units<uint32_t>(dst, src, nbytes, lane);
  } else if (a % 2 == 0) {
    warp_copy_units<uint16_t>(dst, src, nbytes, lane);
  } else {
    warp_copy_units<uint8_t>(dst, src, nbytes, lane);
  }
}

// ---------------------------------------------------------------------------------------------
// Element conversions (raw bits in, fp32 arithmetic, round to nearest even out).
__device__ __forceinline__ float bf16_bits_to_float(uint16_t bits) {
  return __uint_as_float(static_cast<uint32_t>(bits) << 16);
}

// fp32 -> bf16 bits, round to nearest even (kernels/numerics.py cast_rne, bit for bit). NaN is
// kept apart: adding half an ulp to the GPU's NaN 0x7FFFFFFF would carry into the sign bit.
__device__ __forceinline__ uint16_t float_to_bf16_bits(float v) {
  const uint32_t bits = __float_as_uint(v);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float load_as_float(const char* p, int32_t dtype) {
  switch (dtype) {
    case kBF16: return bf16_bits_to_float(*reinterpret_cast<const uint16_t*>(p));
    case kF16: return __half2float(*reinterpret_cast<const __half*>(p));
    case kF32: return *reinterpret_cast<const float*>(p);
    default: return __double2float_rn(*reinterpret_cast<const double*>(p));
  }
}

__device__ __forceinline__ void store_from_float(char* p, int32_t dtype, float v) {
  switch (dtype) {
    case kBF16: *reinterpret_cast<uint16_t*>(p) = float_to_bf16_bits(v); break;
    case kF16: *reinterpret_cast<__half*>(p) = __float2half_rn(v); break;
    case kF32: *reinterpret_cast<float*>(p) = v; break;
    default: *reinterpret_cast<double*>(p) = static_cast<double>(v); break;
  }
}

}  // namespace moe_comm
