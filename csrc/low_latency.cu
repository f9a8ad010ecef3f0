// Low-latency (decode) dispatch and combine in CUDA C++: the four kernels of
// moe_comm/kernels/low_latency.py with the same semantics, workspace layout and signal words, so
// that ranks running either implementation interoperate and a Buffer may switch on every call.
//
// Layout (moe_comm/workspace.py; P = 2 parities, call n uses parity n % 2; S = slot bytes):
//   ll_state            [9] int64          epochs: [0] dispatch sent, [1] dispatch received,
//                                          [2] combine sent, [3] combine received; [4..7] tickets;
//                                          [8] the Triton waits' timed-out flag (not used here)
//   ll_dispatch_signals [P, L, R] int64    [p, e, s] = epoch << 32 | pairs source s put for e
//   ll_combine_signals  [P, R] int64       [p, s] = epoch << 32 | descriptor << kSlotBits of
//                                          expert rank s's puts
//   ll_acks             [2, P, R] int64    on a sender: [c, p, d] = latest epoch of parity p that
//                                          rank d consumed (c: 0 dispatch, 1 combine)
//   ll_dispatch_meta    [P, L, R, T] int32 per slot: source token * 32 + top-k choice
//   ll_dispatch_rows    [P, L, R, T, S]    one slot per (local expert, source, pair): the row of
//                                          x's dtype, or H e4m3 bytes + H/128 fp32 scales (or
//                                          H/128 exponent bytes with UE8M0)
//   ll_combine_rows     [P, T, K, H]       on the home rank, one row per (token, choice)
//   ll_outbox           [T, S] uint8       sources of this rank's NVSHMEM dispatch puts
//   ll_combine_outbox   [L, R * T, H]      sources of this rank's NVSHMEM combine puts
//
// Transport per peer: peer_ptrs[d] != 0 -> plain stores through that address (NVLink, one GPU);
// peer_ptrs[d] == 0 -> warp-level NVSHMEM puts from the outbox (a put's source must be symmetric
// memory) to the symmetric address, meta words with nvshmem_int_p, signals with
// nvshmemx_signal_op(SET). Signals are published by the launch's last block: first to the
// load/store peers, then, after nvshmem_quiet() has completed every put of the launch (the puts
// were issued by other warps, which nvshmem_fence would not order), to the NVSHMEM peers. Since
// every put is complete when a send kernel ends, the outboxes need no second parity.
//
// Waits happen in the kernels (the Triton path waits on the host): a sender waits until every
// destination acknowledged the call two epochs back before writing a parity; a receiver waits for
// the signals. Each wait is bounded by timeout_ns (%globaltimer); on timeout the kernel writes
// (1, peer, expected, observed) into err and stops instead of hanging, publishes nothing and leaves
// the epochs in ll_state as they were (the Buffer must then be treated as failed).
//
// Grids are persistent and fixed by the Buffer's sizes (CUDA-graph safe): the send kernels run
// `num_sms` blocks of 8 warps, one warp per token (dispatch) or per row (combine).
#include "common.cuh"
#include "fp8.cuh"

using namespace moe_comm;

namespace {

constexpr int kMaxTopk = 32;  // meta word = token * 32 + choice

// Warp-collective: for lane k < K holding expert `mine` of pair (t, k), the number of pairs of
// tokens 0..t-1 that picked the same expert (the pair's position in its (expert, source) block).
// The ids are read kInFlight chunks of 32 at a time (all loaded before any is compared).
__device__ int pairs_before(const int64_t* topk_idx, int t, int K, int64_t mine, int lane) {
  int count = 0;
  const int64_t n = static_cast<int64_t>(t) * K;
  for (int64_t base = 0; base < n; base += static_cast<int64_t>(kWarpSize) * kInFlight) {
    int64_t v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kWarpSize + lane;
      v[u] = i < n ? topk_idx[i] : -2;
    }
    for (int k = 0; k < K; ++k) {
      const int64_t target = __shfl_sync(kFullMask, mine, k);
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const unsigned hits = __ballot_sync(kFullMask, target >= 0 && v[u] == target);
        if (lane == k) count += __popc(hits);
      }
    }
  }
  return count;
}

// One token's row in its native dtype to every load/store destination of the warp (dsts[k], null
// for pairs that are invalid or go through NVSHMEM) and, if non-null, to the outbox row.
// kInFlight units per lane loaded before any is stored.
template <typename U>
__device__ void send_row_units(const char* src, int64_t nbytes, char* const* dsts, int K,
                               char* outbox, int lane) {
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(U));
  for (int64_t base = lane; base < n; base += static_cast<int64_t>(kWarpSize) * kInFlight) {
    U v[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int64_t i = base + static_cast<int64_t>(u) * kWarpSize;
      if (i < n) v[u] = reinterpret_cast<const U*>(src)[i];
    }
    for (int k = 0; k < K; ++k) {
      if (dsts[k] == nullptr) continue;
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * kWarpSize;
        if (i < n) reinterpret_cast<U*>(dsts[k])[i] = v[u];
      }
    }
    if (outbox != nullptr) {
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t i = base + static_cast<int64_t>(u) * kWarpSize;
        if (i < n) reinterpret_cast<U*>(outbox)[i] = v[u];
      }
    }
  }
}

__device__ void send_row_raw(const char* src, int64_t nbytes, char* const* dsts, int K,
                             char* outbox, int lane) {
  // slots and outbox rows are 16-byte aligned (slot bytes % 16 == 0, regions 128-aligned)
  const uint64_t a = reinterpret_cast<uint64_t>(src) | static_cast<uint64_t>(nbytes);
  if (a % 16 == 0) {
    send_row_units<uint4>(src, nbytes, dsts, K, outbox, lane);
  } else if (a % 4 == 0) {
    send_row_units<uint32_t>(src, nbytes, dsts, K, outbox, lane);
  } else if (a % 2 == 0) {
    send_row_units<uint16_t>(src, nbytes, dsts, K, outbox, lane);
  } else {
    send_row_units<uint8_t>(src, nbytes, dsts, K, outbox, lane);
  }
}

// One token's row quantized once (warp per group of 128) and stored to every destination;
// kInFlight groups loaded before any is quantized.
__device__ void send_row_fp8(const char* src, int32_t x_dtype, int H, bool ue8m0,
                             char* const* dsts, int K, char* outbox, int lane) {
  const int G = H / kGroup;
  for (int g0 = 0; g0 < G; g0 += kInFlight) {
    float v[kInFlight][4];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      if (g0 + u < G) load4_as_float(src, x_dtype, (g0 + u) * kGroup + lane * 4, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      const int g = g0 + u;
      if (g >= G) break;
      const int h = g * kGroup + lane * 4;
      const QuantGroup q = quantize_group(v[u], ue8m0);
      for (int k = 0; k < K; ++k) {
        if (dsts[k] != nullptr) store_group(dsts[k], H, g, h, q, ue8m0, lane);
      }
      if (outbox != nullptr) store_group(outbox, H, g, h, q, ue8m0, lane);
    }
  }
}

}  // namespace

// =============================================================================================
// Dispatch send: every (token, expert) pair straight into its slot; the last block publishes
// epoch << 32 | count for every expert. Bytes into rank d: pairs(d) * (payload + 4) + 8 * L.
extern "C" __global__ void __launch_bounds__(kThreads) ll_dispatch_send(
    const void* x,                // [T, H] x_dtype
    const int64_t* topk_idx,      // [T, K] int64, -1 = unused
    const int64_t* peer_ptrs,     // [R] int64: segment address per rank, 0 = through NVSHMEM
    const int32_t* pes,           // [R] int32 NVSHMEM PE per rank, or null (PE = rank)
    int64_t* state,               // [8] int64 local ll_state
    int64_t* stats,               // [4] int64 local: bytes stored (to peers, to itself) at 0, 1
    int64_t rows_off, int64_t rows_parity_stride,        // ll_dispatch_rows[0], bytes per parity
    int64_t meta_off, int64_t meta_parity_stride,        // ll_dispatch_meta
    int64_t signals_off, int64_t signals_parity_stride,  // ll_dispatch_signals
    int64_t acks_off, int64_t acks_parity_stride,        // ll_acks[DISPATCH]
    int64_t outbox_off,                                  // ll_outbox [TMAX, S]
    int32_t T, int32_t H, int32_t K, int32_t R, int32_t L, int32_t E, int32_t me, int32_t TMAX,
    int64_t slot_bytes, int32_t x_dtype, int32_t fp8, int32_t ue8m0,
    int32_t descriptor,           // the call's, published above each count (kSlotBits)
    int64_t timeout_ns, int64_t* err) {
  extern __shared__ int32_t s_pairs[];  // [E] pairs per expert (last block)
  __shared__ char* s_dst[kWarps][kMaxTopk];
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const Peers peers{peer_ptrs, pes, me};
  char* const local = peers.local();
  const int64_t epoch = state[0] + 1;
  const int64_t parity = epoch & 1;
  const bool any_remote = block_any_remote(peer_ptrs, R);
  // every destination consumed this parity's previous call (epoch - 2)
  const bool ok = block_wait_all(local + acks_off + parity * acks_parity_stride, 8, R, 0,
                                 epoch - 2, timeout_ns, err);
  const int G = H / kGroup;
  const int64_t payload = fp8 ? H + static_cast<int64_t>(G) * (ue8m0 ? 1 : 4)
                              : static_cast<int64_t>(H) * dtype_bytes(x_dtype);
  const int64_t rows_base = rows_off + parity * rows_parity_stride;
  int64_t to_peers = 0, to_self = 0;
  for (int t = blockIdx.x * kWarps + warp; ok && t < T; t += gridDim.x * kWarps) {
    const int64_t e = lane < K ? topk_idx[static_cast<int64_t>(t) * K + lane] : -1;
    const int j = pairs_before(topk_idx, t, K, e, lane);
    const bool valid = e >= 0;
    const int d = valid ? static_cast<int>(e / L) : 0;
    const int64_t block =
        ((e - static_cast<int64_t>(d) * L) * R + me) * static_cast<int64_t>(TMAX) + j;
    char* const direct = valid ? peers.direct(d) : nullptr;
    const bool remote = valid && direct == nullptr;
    if (valid) {  // the pair's meta word, and its bytes
      const int32_t word = t * kMaxTopk + lane;
      const int64_t meta = meta_off + parity * meta_parity_stride + block * 4;
      if (remote) {
        nvshmem_int_p(reinterpret_cast<int*>(local + meta), word, peers.pe(d));
      } else {
        *reinterpret_cast<int32_t*>(direct + meta) = word;
      }
      (d != me ? to_peers : to_self) += payload + 4;
    }
    if (lane < K) s_dst[warp][lane] = valid && !remote ? direct + rows_base + block * slot_bytes
                                                       : nullptr;
    const unsigned remote_lanes = __ballot_sync(kFullMask, remote);
    char* const outbox =
        remote_lanes ? local + outbox_off + static_cast<int64_t>(t) * slot_bytes : nullptr;
    __syncwarp();
    const char* row = static_cast<const char*>(x) +
                      static_cast<int64_t>(t) * H * dtype_bytes(x_dtype);
    if (fp8) {
      send_row_fp8(row, x_dtype, H, ue8m0 != 0, s_dst[warp], K, outbox, lane);
    } else {
      send_row_raw(row, payload, s_dst[warp], K, outbox, lane);
    }
    __syncwarp();
    if (remote_lanes) {  // the outbox row is complete: one put per pair through NVSHMEM
      __threadfence();
      for (unsigned m = remote_lanes; m != 0; m &= m - 1) {
        const int k = __ffs(m) - 1;
        const int64_t blk = __shfl_sync(kFullMask, block, k);
        const int dk = __shfl_sync(kFullMask, d, k);
        nvshmemx_putmem_nbi_warp(local + rows_base + blk * slot_bytes, outbox,
                                 static_cast<size_t>(payload), peers.pe(dk));
      }
    }
    __syncwarp();
  }
  block_add_stats(stats, 0, to_peers, to_self);
  bool any_failed = false;
  if (!draw_last_block(state + 4, !ok, &any_failed) || any_failed) return;

  // Last block: count the pairs per expert and publish them.
  for (int i = threadIdx.x; i < E; i += blockDim.x) s_pairs[i] = 0;
  __syncthreads();
  for (int64_t i = threadIdx.x; i < static_cast<int64_t>(T) * K; i += blockDim.x) {
    const int64_t e = topk_idx[i];
    if (e >= 0) atomicAdd(&s_pairs[e], 1);
  }
  __syncthreads();
  const int64_t signals_base = signals_off + parity * signals_parity_stride;
  for (int pass = 0; pass < 2; ++pass) {  // load/store peers first, then NVSHMEM peers
    if (pass == 1) {
      if (!any_remote) break;
      if (threadIdx.x == 0) nvshmem_quiet();  // every put of this launch has landed
      __syncthreads();
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
      const int d = e / L;
      if ((peers.direct(d) == nullptr) != (pass == 1)) continue;
      const int64_t offset = signals_base + ((static_cast<int64_t>(e) - d * L) * R + me) * 8;
      publish_word(peers, d, offset,
                   (epoch << 32) | (static_cast<int64_t>(descriptor) << kSlotBits) |
                       static_cast<int64_t>(s_pairs[e]));
    }
  }
  if (threadIdx.x == 0) {
    state[0] = epoch;
    atomicAdd(reinterpret_cast<unsigned long long*>(stats), 8ull * (E - L));
    atomicAdd(reinterpret_cast<unsigned long long*>(stats + 1), 8ull * L);
  }
}

// =============================================================================================
// Dispatch receive: item (e, s) waits for expert e's signals, copies source s's block to the
// compact expert-major output (sources in rank order, tokens in order) and records where each row
// came from; the last block acknowledges the parity to every source.
extern "C" __global__ void __launch_bounds__(kThreads, 2) ll_dispatch_recv(
    const char* staging,          // [P, L, R, TMAX, S] local ll_dispatch_rows
    const int32_t* meta,          // [P, L, R, TMAX] int32 local ll_dispatch_meta
    const int64_t* signals,       // [P, L, R] int64 local ll_dispatch_signals
    const int64_t* peer_ptrs,     // [R] int64
    const int32_t* pes,           // [R] int32 or null
    int64_t* state,               // [8] int64 local ll_state
    char* out,                    // [L, R * TMAX, H]: row_bytes per row (FP8: e4m3 bytes)
    char* out_scales,             // FP8: fp32 scales, or the bytes of packed int32 UE8M0 words
    int32_t* count,               // [L] int32 out
    int32_t* src_info,            // [L, R * TMAX] int32 out: source rank * TMAX + source token
    int32_t* src_k,               // [L, R * TMAX] int32 out: top-k choice at the home rank
    int32_t* layout,              // [L, R, 2] int32 out: (first row, rows) per source block
    void* recv_stats,             // [L] int32/int64 added to, or null
    int32_t recv_stats_int64,
    int64_t acks_off, int64_t acks_parity_stride,  // ll_acks[DISPATCH] (on the sources)
    int32_t H, int32_t R, int32_t L, int32_t me, int32_t TMAX, int64_t slot_bytes,
    int64_t row_bytes,            // bytes of one output row
    int64_t scale_row_stride, int64_t scale_group_stride, int64_t scale_expert_stride,
    int32_t fp8, int32_t ue8m0, int64_t timeout_ns, int64_t* err,
    int64_t* input_err) {         // [4] the input part of the error record, or null
  extern __shared__ int32_t s_counts[];  // [R] pairs per source of the current expert
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const Peers peers{peer_ptrs, pes, me};
  const int64_t epoch = state[1] + 1;
  const int64_t parity = epoch & 1;
  const int G = H / kGroup;
  bool ok = true;
  for (int item = blockIdx.x; item < L * R; item += gridDim.x) {
    const int e = item / R, s = item % R;
    const int64_t* words = signals + (parity * L + e) * R;
    ok = block_wait_all(reinterpret_cast<const char*>(words), 8, R, 32, epoch, timeout_ns, err);
    if (!ok) break;
    for (int i = threadIdx.x; i < R; i += blockDim.x) {
      s_counts[i] = static_cast<int32_t>(load_acquire(words + i) & 0xFFFFFFFFll);
    }
    __syncthreads();
    if (s == 0 && threadIdx.x == 0) {  // a source with another call descriptor, once per expert
      const int64_t mine = s_counts[me] >> kSlotBits;
      for (int i = 0; i < R; ++i) {
        if ((s_counts[i] >> kSlotBits) != mine) {
          record_call_differs(input_err, i, s_counts[i] >> kSlotBits, mine, epoch);
          break;
        }
      }
    }
    __syncthreads();  // (the check read every word before the descriptors are masked off)
    for (int i = threadIdx.x; i < R; i += blockDim.x) s_counts[i] &= kSlotMask;
    __syncthreads();
    int first = 0, total = 0;
    for (int i = 0; i < R; ++i) {
      first += i < s ? s_counts[i] : 0;
      total += s_counts[i];
    }
    const int n = s_counts[s];
    if (threadIdx.x == 0) {
      layout[(e * R + s) * 2] = first;
      layout[(e * R + s) * 2 + 1] = n;
      if (s == 0) {
        count[e] = total;
        if (recv_stats != nullptr) {
          if (recv_stats_int64) {
            static_cast<int64_t*>(recv_stats)[e] += total;
          } else {
            static_cast<int32_t*>(recv_stats)[e] += total;
          }
        }
      }
    }
    const int64_t block0 = ((parity * L + e) * R + s) * static_cast<int64_t>(TMAX);
    for (int j = warp; j < n; j += kWarps) {
      const int64_t slot = block0 + j;
      const int64_t dst = static_cast<int64_t>(e) * R * TMAX + first + j;
      const int32_t word = meta[slot];
      if (lane == 0) {
        src_info[dst] = s * TMAX + word / kMaxTopk;
        src_k[dst] = word % kMaxTopk;
      }
      const char* src = staging + slot * slot_bytes;
      warp_copy(out + dst * row_bytes, src, row_bytes, lane);
      if (fp8) {
        const int64_t out_row = first + j;
        for (int g = lane; g < G; g += kWarpSize) {
          if (ue8m0) {
            const int64_t word4 = e * scale_expert_stride + (g / 4) * scale_group_stride +
                                  out_row * scale_row_stride;
            out_scales[word4 * 4 + g % 4] = src[H + g];
          } else {
            reinterpret_cast<float*>(out_scales)[e * scale_expert_stride +
                                                 g * scale_group_stride +
                                                 out_row * scale_row_stride] =
                reinterpret_cast<const float*>(src + H)[g];
          }
        }
      }
    }
    __syncthreads();  // s_counts is rewritten by the next item
  }
  bool any_failed = false;
  if (!draw_last_block(state + 5, !ok, &any_failed) || any_failed) return;
  for (int src = threadIdx.x; src < R; src += blockDim.x) {  // parity consumed: tell every source
    publish_word(peers, src, acks_off + parity * acks_parity_stride + static_cast<int64_t>(me) * 8,
                 epoch);
  }
  if (threadIdx.x == 0) state[1] = epoch;
}

// =============================================================================================
// Combine send: each received row goes back to its home rank's slot [token, choice]; the last
// block publishes epoch << 32 | descriptor << kSlotBits to every rank (a refused call sends no
// rows). Bytes: rows * H * b + 8 per rank.
extern "C" __global__ void __launch_bounds__(kThreads, 2) ll_combine_send(
    const char* y,                // [L, R * TMAX, H] expert outputs, rows as the dispatch output
    const int32_t* layout,        // [L, R, 2] int32: (first row, rows) per source block
    const int32_t* src_info,      // [L, R * TMAX] int32: source rank * TMAX + source token
    const int32_t* src_k,         // [L, R * TMAX] int32: top-k choice at the home rank
    const int64_t* peer_ptrs,     // [R] int64
    const int32_t* pes,           // [R] int32 or null
    int64_t* state,               // [8] int64 local ll_state
    int64_t* stats,               // [4] int64 local: bytes stored (to peers, to itself) at 2, 3
    int64_t rows_off, int64_t rows_parity_stride,        // ll_combine_rows
    int64_t signals_off, int64_t signals_parity_stride,  // ll_combine_signals
    int64_t acks_off, int64_t acks_parity_stride,        // ll_acks[COMBINE]
    int64_t outbox_off,                                  // ll_combine_outbox [L, R * TMAX, H]
    int32_t H, int32_t R, int32_t L, int32_t me, int32_t TMAX, int32_t KMAX,
    int64_t row_bytes,
    int32_t descriptor,           // the call's (moe_comm.call_descriptor), above the epoch's
    int64_t timeout_ns, int64_t* err) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const Peers peers{peer_ptrs, pes, me};
  char* const local = peers.local();
  const bool refused = (descriptor >> kRefusedBit) & 1;  // a refused call sends no rows
  const int64_t epoch = state[2] + 1;
  const int64_t parity = epoch & 1;
  const bool any_remote = block_any_remote(peer_ptrs, R);
  const bool ok = block_wait_all(local + acks_off + parity * acks_parity_stride, 8, R, 0,
                                 epoch - 2, timeout_ns, err);
  const int64_t rows_base = rows_off + parity * rows_parity_stride;
  int64_t to_peers = 0, to_self = 0;
  for (int item = blockIdx.x; ok && item < L * R; item += gridDim.x) {
    const int e = item / R, s = item % R;
    const int first = layout[(e * R + s) * 2];
    const int n = refused ? 0 : layout[(e * R + s) * 2 + 1];
    char* const direct = peers.direct(s);
    if (threadIdx.x == 0) (s != me ? to_peers : to_self) += n * row_bytes;
    for (int j = warp; j < n; j += kWarps) {
      const int64_t row = static_cast<int64_t>(e) * R * TMAX + first + j;
      const int64_t token = src_info[row] - static_cast<int64_t>(s) * TMAX;
      const int64_t slot = token * KMAX + src_k[row];
      const int64_t offset = rows_base + slot * row_bytes;
      if (direct != nullptr) {
        warp_copy(direct + offset, y + row * row_bytes, row_bytes, lane);
      } else {
        char* const outbox = local + outbox_off + row * row_bytes;
        warp_copy(outbox, y + row * row_bytes, row_bytes, lane);
        __syncwarp();
        __threadfence();
        nvshmemx_putmem_nbi_warp(local + offset, outbox, static_cast<size_t>(row_bytes),
                                 peers.pe(s));
      }
    }
  }
  block_add_stats(stats, 2, to_peers, to_self);
  bool any_failed = false;
  if (!draw_last_block(state + 6, !ok, &any_failed) || any_failed) return;
  const int64_t word = signals_off + parity * signals_parity_stride + static_cast<int64_t>(me) * 8;
  for (int pass = 0; pass < 2; ++pass) {  // load/store peers first, then NVSHMEM peers
    if (pass == 1) {
      if (!any_remote) break;
      if (threadIdx.x == 0) nvshmem_quiet();
      __syncthreads();
    }
    for (int d = threadIdx.x; d < R; d += blockDim.x) {
      if ((peers.direct(d) == nullptr) == (pass == 1)) {
        publish_word(peers, d, word,
                     (epoch << 32) | (static_cast<int64_t>(descriptor) << kSlotBits));
      }
    }
  }
  if (threadIdx.x == 0) {
    state[2] = epoch;
    atomicAdd(reinterpret_cast<unsigned long long*>(stats + 2), 8ull * (R - 1));
    atomicAdd(reinterpret_cast<unsigned long long*>(stats + 3), 8ull);
  }
}

// =============================================================================================
// Combine receive: out[t] = sum_k w[t, k] * slot[t, k] in fp32 (choice order), rounded to nearest
// even; the last block acknowledges the parity to every rank.
namespace {

// V channels of a row as fp32: V = 8 (16-bit types) or 4 (fp32) with one 16-byte load, or V = 1.
template <int V>
__device__ __forceinline__ void load_channels(const char* p, int32_t dtype, float* v) {
  if constexpr (V == 8) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint16_t bits = static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2)));
      v[i] = dtype == kBF16 ? bf16_bits_to_float(bits) : __half2float(__ushort_as_half(bits));
    }
  } else if constexpr (V == 4) {
    const float4 f = *reinterpret_cast<const float4*>(p);
    v[0] = f.x, v[1] = f.y, v[2] = f.z, v[3] = f.w;
  } else {
    v[0] = load_as_float(p, dtype);
  }
}

// V fp32 values rounded to nearest even into the row's dtype (one 16-byte store for V > 1).
template <int V>
__device__ __forceinline__ void store_channels(char* p, int32_t dtype, const float* v) {
  if constexpr (V == 8) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t half[2];
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        half[u] = dtype == kBF16 ? float_to_bf16_bits(v[2 * i + u])
                                 : __half_as_ushort(__float2half_rn(v[2 * i + u]));
      }
      w[i] = half[0] | (half[1] << 16);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (V == 4) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  } else {
    store_from_float(p, dtype, v[0]);
  }
}

// Warp-collective, one token: out[t, h] = sum over valid k of w[t, k] * slot[t, k, h] in fp32, in
// choice order, multiply and add each rounded (as moe_comm.reference computes it), rounded to the
// row dtype at the end. Lane k < K holds choice k's expert and weight. kChoices choices' slots
// are loaded before any is added (a token's top-8 in one round trip per channel chunk).
constexpr int kChoices = 8;

template <int V>
__device__ void combine_token(const char* staging, const int64_t* topk_idx,
                              const float* topk_weights, char* out, int64_t t, int H, int K,
                              int64_t parity, int TMAX, int KMAX, int32_t dtype, int lane,
                              int warp) {
  const int64_t b = dtype_bytes(dtype);
  const int64_t e_mine = lane < K ? topk_idx[t * K + lane] : -1;
  const float w_mine =
      lane < K && topk_weights != nullptr && e_mine >= 0 ? topk_weights[t * K + lane] : 0.0f;
  // the block's warps split the row: warp w takes chunks w, w + kWarps, ... of 32 x V channels
  for (int64_t h0 = static_cast<int64_t>(warp) * kWarpSize * V; h0 < H;
       h0 += static_cast<int64_t>(kWarps) * kWarpSize * V) {
    const int64_t h = h0 + static_cast<int64_t>(lane) * V;
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; ++i) acc[i] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += kChoices) {
      float v[kChoices][V];
      float w[kChoices];
      bool valid[kChoices];
#pragma unroll
      for (int u = 0; u < kChoices; ++u) {
        const int k = k0 + u;
        const int64_t e = __shfl_sync(kFullMask, e_mine, k < K ? k : 0);
        w[u] = __shfl_sync(kFullMask, w_mine, k < K ? k : 0);
        valid[u] = k < K && e >= 0 && h < H;
        if (valid[u]) {
          load_channels<V>(staging + (((parity * TMAX + t) * KMAX + k) * H + h) * b, dtype,
                           v[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kChoices; ++u) {
        if (!valid[u]) continue;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          acc[i] = __fadd_rn(acc[i], topk_weights != nullptr ? __fmul_rn(v[u][i], w[u])
                                                             : v[u][i]);
        }
      }
    }
    if (h < H) store_channels<V>(out + (t * H + h) * b, dtype, acc);
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kThreads) ll_combine_recv(
    const char* staging,          // [P, TMAX, KMAX, H] local ll_combine_rows
    const int64_t* topk_idx,      // [T, K] int64
    const float* topk_weights,    // [T, K] float32, or null (plain sum)
    char* out,                    // [T, H] dtype
    const int64_t* signals,       // [P, R] int64 local ll_combine_signals
    const int64_t* peer_ptrs,     // [R] int64
    const int32_t* pes,           // [R] int32 or null
    int64_t* state,               // [8] int64 local ll_state
    int64_t acks_off, int64_t acks_parity_stride,  // ll_acks[COMBINE] (on the expert ranks)
    int32_t T, int32_t H, int32_t K, int32_t R, int32_t me, int32_t TMAX, int32_t KMAX,
    int32_t dtype, int64_t timeout_ns, int64_t* err,
    int64_t* input_err) {         // [4] the input part of the error record, or null
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const Peers peers{peer_ptrs, pes, me};
  const int64_t epoch = state[3] + 1;
  const int64_t parity = epoch & 1;
  const bool ok = block_wait_all(reinterpret_cast<const char*>(signals + parity * R), 8, R, 32,
                                 epoch, timeout_ns, err);
  if (ok && blockIdx.x == 0 && threadIdx.x == 0) {  // an expert rank with another descriptor
    const int64_t* words = signals + parity * R;
    const int64_t mine = (load_acquire(words + me) & 0xFFFFFFFFll) >> kSlotBits;
    for (int i = 0; i < R; ++i) {
      const int64_t theirs = (load_acquire(words + i) & 0xFFFFFFFFll) >> kSlotBits;
      if (theirs != mine) {
        record_call_differs(input_err, i, theirs, mine, epoch);
        break;
      }
    }
  }
  // 16-byte vectors of channels where H and the addresses allow, else one channel per lane
  const int b = dtype_bytes(dtype);
  const bool wide = (static_cast<int64_t>(H) * b) % 16 == 0 &&
                    (reinterpret_cast<uint64_t>(out) | reinterpret_cast<uint64_t>(staging)) % 16 == 0;
  for (int64_t t = blockIdx.x; ok && t < T; t += gridDim.x) {  // a block per token
    if (wide && b == 2) {
      combine_token<8>(staging, topk_idx, topk_weights, out, t, H, K, parity, TMAX, KMAX, dtype,
                       lane, warp);
    } else if (wide && b == 4) {
      combine_token<4>(staging, topk_idx, topk_weights, out, t, H, K, parity, TMAX, KMAX, dtype,
                       lane, warp);
    } else {
      combine_token<1>(staging, topk_idx, topk_weights, out, t, H, K, parity, TMAX, KMAX, dtype,
                       lane, warp);
    }
  }
  bool any_failed = false;
  if (!draw_last_block(state + 7, !ok, &any_failed) || any_failed) return;
  for (int d = threadIdx.x; d < R; d += blockDim.x) {  // slots read: acknowledge to every rank
    publish_word(peers, d, acks_off + parity * acks_parity_stride + static_cast<int64_t>(me) * 8,
                 epoch);
  }
  if (threadIdx.x == 0) state[3] = epoch;
}
