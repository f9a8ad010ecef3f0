"""The workspace layout: every byte offset of a Buffer's symmetric segment, in one place.

Each rank's segment holds the same regions at the same offsets. ``R`` ranks, ``T`` =
``max_tokens_per_rank``, ``H`` = hidden, ``L`` = local experts, ``K`` = ``max_topk``, ``b`` = bytes
per element of the Buffer's dtype. ``P = 2`` parities: epoch ``n`` of a channel uses parity
``n % 2`` (see ``moe_comm.buffer`` for why two are enough). ``W`` = ``ring_slots``: the normal
mode's staging slots per source, ``T`` unless ``staging_bytes`` bounds them
(:func:`ring_slots_for`; then a call runs in ``ceil(T / W)`` rounds of one epoch each,
``moe_comm.normal_mode``).

======================  ===========================  ============================================
region                  shape, dtype                 contents, on rank ``d``
======================  ===========================  ============================================
``signals``             [2 channels, R] int64        ``[c, s]``: latest epoch of channel ``c``
                                                     (0 dispatch, 1 combine) at which rank ``s``
                                                     finished its puts into ``d`` (combine:
                                                     ``epoch << 32 | descriptor << 18``). Never
                                                     reset.
``tickets``             [10] int64                   local: programs finished so far of the
                                                     dispatch and combine sends, then of the
                                                     internode kernels (``kernels.internode``),
                                                     then of the rounds in one launch
                                                     (``kernels.dispatch_rounds``, 5,
                                                     ``kernels.combine_rounds``, 6, and
                                                     ``kernels.invariant_rounds``, 7), then of
                                                     the forwarder's pass in the combine's
                                                     (8) and in the dispatch's (9)
``epochs``              [2 channels] int64           local: epoch of this rank's latest send
                                                     per channel (the send's last program
                                                     advances it; kernels take epoch and parity
                                                     from here, never from the host)
``stats``               [4] int64                    local: bytes ``d`` stored, cumulative:
                                                     dispatch to peers, dispatch to itself,
                                                     combine to peers, combine to itself
``xstats``              [4] int64                    local: bytes written to outboxes for the
                                                     transport (dispatch, combine), bytes
                                                     forwarded for other nodes (dispatch,
                                                     combine)
``ft_mask``             [R] int64                    fault tolerance: word ``p`` is 0 while rank
                                                     ``p`` is active, else 1 + the rank that
                                                     excluded it (written on every rank)
``ft_clean``            [2, R] int64                 ``clean_mask``: round ``i``'s serial that
                                                     rank ``s`` reached
``ft_epochs``           [R, 4] int64                 ``clean_mask``: rank ``s``'s epochs (dispatch,
                                                     combine, low-latency dispatch and combine)
``dispatch_counts``     [P, R, L + 1] int32          from source ``s``: tokens per local expert,
                                                     then the number of slots ``s`` filled (in
                                                     this round) with ``s``'s call descriptor
                                                     above bit 18 (``moe_comm.call_descriptor``)
``dispatch_meta``       [P, R, W, 1 + 3K] int32      per slot: source token index; per top-k
                                                     choice: global expert id or -1, position
                                                     among ``s``'s tokens for that expert,
                                                     weight bits
``dispatch_rows``       [P, R, W, H] dtype           the token rows, one per (token, ``d``)
``combine_meta``        [P, R, W, K] float32         per slot and choice: a value sent back
                                                     (the gradient of a router weight)
``combine_rows``        [P, R, W, H] dtype           one partial sum per (token, expert rank)
======================  ===========================  ============================================

Total (each region, and each parity's half of a region stored by parity, rounded up to 128
bytes)::

    2*R*W*(2*H*b + 4*(1 + 3K) + 4*K) + 2*R*(L + 1)*4 + 72*R + 64 + 16 + 32 + 32   # + rounding

With ``low_latency=True`` (``S`` = bytes of one low-latency slot = ``H*b`` rounded up to 16,
or ``H + 4*H/128`` if that is larger, so that FP8 rows with their scales fit too):

======================  ===========================  ============================================
``ll_state``            [9] int64                    local: device epochs (dispatch sent/received,
                                                     combine sent/received), kernel tickets, and
                                                     1 once a low-latency wait timed out
``ll_dispatch_signals`` [P, L, R] int64              ``[p, e, s]``: ``epoch << 32 | descriptor
                                                     << 18 | pairs`` that source ``s`` put for
                                                     local expert ``e``
``ll_combine_signals``  [P, R] int64                 ``[p, s]``: ``epoch << 32 | descriptor <<
                                                     18`` of expert rank ``s``'s puts
``ll_acks``             [2 channels, P, R] int64     on a sender: ``[c, p, d]``, the latest epoch
                                                     of parity ``p`` that rank ``d`` consumed
``ll_dispatch_meta``    [P, L, R, T] int32           per slot: source token * 32 + top-k choice
``ll_dispatch_rows``    [P, L, R, T, S] uint8        one slot per (local expert, source, pair)
``ll_combine_rows``     [P, T, K, H] dtype           on the home rank: one row per (token, choice)
======================  ===========================  ============================================

Low-latency total: ``2*L*R*T*(S + 4) + 2*T*K*H*b + 8*(2*L*R + 6*R + 8)`` (+ rounding).

With ``invariant=True`` (``Buffer(..., ep_invariant=True)``, ``kernels.invariant``) the normal
mode's combine returns every (token, choice) row on its own, into the home rank's slot of that
pair in the round's window:

======================  ===========================  ============================================
``inv_rows``            [P, W*K, H] dtype            on the home rank: row ``(t % W) * K + k``,
                                                     the expert output of token t's choice k
``inv_meta``            [P, W*K, 2] float32          its weight and its per-choice value
======================  ===========================  ============================================

They add ``2*W*K*(H*b + 8)`` bytes (``staging_slot_bytes(..., invariant=True)``). Across nodes
through the proxy (flat) the rows for homes on other nodes wait in outboxes at the same index:
``inv_box_rows`` [P, R, W*K, H] dtype and ``inv_box_meta`` [P, R, W*K, 2] float32 (a slice per
rank; those of the rank's own node unused), ``2*R*W*K*(H*b + 8)`` bytes more.

Across nodes (``rdma=True``: NVSHMEM puts, whose source must be symmetric memory) the normal
mode adds outboxes for what it puts, a round's worth (``W`` slots): ``rdma_rows`` [P, W, H*b]
uint8 and ``rdma_meta`` [P, W, 1 + 3K] int32 (each token of the round's window: its row and
metadata once), ``rdma_counts`` [P, R, L + 1] int32, ``rdma_combine_rows`` [P, R, W, H] and
``rdma_combine_meta`` [P, R, W, K] float32 (a partial per ring slot of each home); the
low-latency mode adds ``ll_outbox`` [P, T, S] uint8 (each token's row once, put from there)
and ``ll_combine_outbox`` [P, L, R*T, H] dtype (expert outputs put from there; the caller may
write them there directly: ``Buffer.low_latency_combine_buffer``). The proxy transport adds the
same two, and ``ll_meta_table`` [T, K] int32 (``t * 32 + k``, written once: the proxy copies a
pair's meta word from there).

Nodes (``ranks_per_node = N`` < R; ``M = R / N`` nodes; rank ``r`` is local index ``r % N`` of node
``r // N``). Peers on other nodes have no pointer; the proxy transport (``transport="nixl"``)
moves what they get from this rank's outboxes (``moe_comm.transport``). Flat mode
(``hierarchical=False``): one outbox slice per destination rank, ``D = R``. Hierarchical mode:
one per destination node, ``D = M``, and a token's node metadata adds the slot it takes on each
of the ``N`` ranks of that node (``MN = 1 + 3K + N`` words). ``ROW = H*b``. Every ``W`` below is
a round's slots: a window of ``W`` tokens sends at most ``W`` rows to any rank or node.

======================  ===========================  ============================================
``px_rows``             [P, D, W, ROW] uint8         dispatch rows for destination (rank or node)
``px_meta``             [P, D, W, MN] int32          their metadata (``MN = 1 + 3K`` when flat)
``px_counts``           [P, D, C] int32              flat: ``C = L + 1`` (the counts of
                                                     ``dispatch_counts``); hierarchical:
                                                     ``C = N*(L + 1) + 1``: the counts of each
                                                     rank of the node, then the node's rows
``px_combine_rows``     [P, D, W, H] dtype           combine partials for home rank (flat) or
                                                     node sums for source node (hierarchical)
``px_combine_meta``     [P, D, W, K] float32         their per-choice values
======================  ===========================  ============================================

Hierarchical mode only, on the forwarder (the rank of each node with the source's local index):

======================  ===========================  ============================================
``node_signals``        [2 channels, M] int64        dispatch: epoch of node ``a``'s message
                                                     (raised by the proxy); combine: unused
``fwd_rows``            [P, M, W, ROW] uint8         rows from node ``a``'s rank with my local
``fwd_meta``            [P, M, W, MN] int32          index, their node metadata and counts
``fwd_counts``          [P, M, C] int32
``hc_signals``          [N] int64                    combine: ``epoch << 32 | descriptor << 18``
                                                     of local rank ``l``'s partials for remote
                                                     tokens
``hc_rows``             [P, M, N, W, H] dtype        partial of local rank ``l`` for slot ``j``
``hc_meta``             [P, M, N, W, K] float32      of source (``a``, my local index)
``hcomb_rows``          [P, M, W, H] dtype           on the home rank: node ``b``'s sum per
``hcomb_meta``          [P, M, W, K] float32         node row (``M`` rows per token at most)
======================  ===========================  ============================================
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN_BYTES = 128
PARITIES = 2
DISPATCH, COMBINE = 0, 1  # channels
# Regions whose per-parity slices the kernels take as tensors: each slice starts on a 128-byte
# boundary, so both parities give a kernel the same alignment (one compiled variant). The other
# regions are passed whole and the kernels step through their parities themselves.
_PARITY_SLICED = ("dispatch_counts", "dispatch_meta", "dispatch_rows", "combine_meta",
                  "combine_rows", "px_rows", "px_meta", "px_counts", "px_combine_rows",
                  "px_combine_meta", "fwd_rows", "fwd_meta", "fwd_counts", "hc_rows", "hc_meta",
                  "hcomb_rows", "hcomb_meta", "inv_rows", "inv_meta", "inv_box_rows",
                  "inv_box_meta")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def low_latency_slot_bytes(hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one low-latency staging slot: a row of ``dtype`` or an FP8 row with scales."""
    row = hidden * torch.empty((), dtype=dtype).element_size()
    fp8 = hidden + 4 * ((hidden + 127) // 128)
    return _round_up(max(row, fp8), 16)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize  # (no tensor made: the host path calls it)


STAGING_REGIONS = ("dispatch_meta", "dispatch_rows", "combine_meta", "combine_rows")
# across nodes through the proxy: a slot of each destination's outbox per staging slot
OUTBOX_REGIONS = ("px_meta", "px_rows", "px_combine_meta", "px_combine_rows")
# across hosts over NVSHMEM: the outboxes the puts read, a token's row once per slot, a partial
# per slot of each home
RDMA_REGIONS = ("rdma_rows", "rdma_meta", "rdma_combine_rows", "rdma_combine_meta")
# hierarchical: the forwarders' regions, a slot per source node (per local rank for hc_*)
FORWARDER_REGIONS = ("fwd_meta", "fwd_rows", "hc_meta", "hc_rows", "hcomb_meta", "hcomb_rows")
# the EP-invariant combine: a row and two floats per (token, choice) of a round's window
INVARIANT_REGIONS = ("inv_rows", "inv_meta")
INVARIANT_OUTBOX_REGIONS = ("inv_box_rows", "inv_box_meta")  # flat through the proxy
# The normal mode's default staging budget: a DeepSeek-V3 rank (H 7168, bf16, top-8, 4096
# tokens) keeps its whole staging at EP 8 (1.76 GiB, one round) and stays under 2 GiB at any
# EP size (EP 64: 544 slots per source, 8 rounds).
DEFAULT_STAGING_BYTES = 15 << 27  # 1.875 GiB


# Ring slots are a multiple of this where there are at least as many: every round's window of a
# call's per-token tensors (rows, scales, ring positions, weights) then starts 16-byte aligned
# as the first does, so a kernel keeps one specialisation across rounds.
RING_SLOT_MULTIPLE = 16


def staging_slot_bytes(world_size: int, hidden: int, max_topk: int, dtype: torch.dtype,
                       outboxes: bool = False, ranks_per_node: int | None = None,
                       rdma: bool = False, invariant: bool = False) -> int:
    """Bytes one slot index costs in the normal mode's staging: for every source and both
    parities, a dispatch row and its metadata, a combine row and its per-choice values.
    ``outboxes`` (across nodes through the proxy) adds the outboxes' slots
    (``OUTBOX_REGIONS``): flat, as much again (a slot per destination rank); with
    ``ranks_per_node = N`` (hierarchical, ``M = R / N`` nodes) a slot per destination node
    (node metadata of ``1 + 3K + N`` words) and the forwarders' regions
    (``FORWARDER_REGIONS``: a row and node metadata per source node, a partial per local rank
    and source node, a node sum per node); ``rdma`` (across hosts over NVSHMEM) adds the
    outboxes the puts read (``RDMA_REGIONS``: a row and metadata per slot, a partial and its
    values per slot of each home)::

        flat:          2 * per_slot
        hierarchical:  per_slot + 2 * (M * (4*ROW + 8*(1 + 3K + N) + 8K) + R * (ROW + 4K))
        NVSHMEM:       per_slot + 2 * (ROW + 4*(1 + 3K) + R * (ROW + 4K))

    ``invariant`` (the EP-invariant combine) adds ``2 * K * (ROW + 8)``: a row and two floats
    per (token, choice) of the window (``INVARIANT_REGIONS``); with ``outboxes`` (flat through
    the proxy) ``2 * R * K * (ROW + 8)`` more, an outbox slot per rank.
    """
    row = hidden * _itemsize(dtype)
    R, K = world_size, max_topk
    per_slot = PARITIES * R * (2 * row + 4 * (1 + 3 * K) + 4 * K)
    extra = PARITIES * K * (row + 8) * (1 + (R if outboxes else 0)) if invariant else 0
    if rdma:
        if outboxes:
            raise ValueError("a Buffer across nodes moves rows either over NVSHMEM (rdma) or "
                             "through the proxy's outboxes, not both")
        return per_slot + PARITIES * (row + 4 * (1 + 3 * K) + R * (row + 4 * K)) + extra
    if not outboxes:
        return per_slot + extra
    if ranks_per_node is None:
        return 2 * per_slot + extra
    M, node_meta = R // ranks_per_node, 1 + 3 * K + ranks_per_node
    return (per_slot + PARITIES * (M * (4 * row + 8 * node_meta + 8 * K) + R * (row + 4 * K))
            + extra)


def ring_slots_for(staging_bytes: int | None, world_size: int, max_tokens: int, hidden: int,
                   max_topk: int, dtype: torch.dtype, outboxes: bool = False,
                   ranks_per_node: int | None = None, rdma: bool = False,
                   invariant: bool = False) -> int:
    """Staging slots per source and parity that ``staging_bytes`` pays for (None: the
    default budget; ``outboxes`` / ``ranks_per_node`` / ``rdma``: it pays for the outboxes' and
    the forwarders' slots too, as :func:`staging_slot_bytes` counts them; ``invariant``: the
    EP-invariant combine's), at most ``max_tokens``
    (then a call is one round, the whole batch), else rounded down to a multiple of
    ``RING_SLOT_MULTIPLE`` where that leaves any."""
    budget = DEFAULT_STAGING_BYTES if staging_bytes is None else staging_bytes
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"staging_bytes must be a positive int or None, got {staging_bytes!r}")
    per_slot = staging_slot_bytes(world_size, hidden, max_topk, dtype, outboxes,
                                  ranks_per_node, rdma, invariant)
    if budget < per_slot:
        raise ValueError(f"staging_bytes={budget} is less than one slot per source: the normal "
                         f"mode needs at least {per_slot} bytes at world size {world_size} "
                         f"(2 parities x {world_size} sources x one dispatch and one combine "
                         "row with their metadata" + (", in the staging and in the outboxes)"
                                                      if outboxes else ")")
                         + (" and the forwarders' regions" if ranks_per_node else "")
                         + (" and the NVSHMEM outboxes" if rdma else ""))
    slots = budget // per_slot
    if slots < max_tokens and slots >= RING_SLOT_MULTIPLE:  # rounds' windows stay aligned
        slots -= slots % RING_SLOT_MULTIPLE
    return min(max_tokens, slots)


@dataclass(frozen=True)
class Region:
    """``shape`` of ``dtype`` at ``offset``. With ``by_parity`` (the first dimension is the
    parity) each parity's slice starts at a multiple of 128 bytes (``parity_stride``), so a
    kernel handed ``region[p]`` sees the same alignment for both parities (and compiles once)."""

    name: str
    offset: int  # bytes from the segment start
    shape: tuple[int, ...]
    dtype: torch.dtype
    by_parity: bool = False

    @property
    def dense_nbytes(self) -> int:
        n = _itemsize(self.dtype)
        for s in self.shape:
            n *= s
        return n

    @property
    def parity_stride(self) -> int:
        """Bytes between ``region[0]`` and ``region[1]`` (regions whose first dim is a parity)."""
        dense = self.dense_nbytes // self.shape[0]
        return _round_up(dense, ALIGN_BYTES) if self.by_parity else dense

    @property
    def nbytes(self) -> int:
        return self.parity_stride * self.shape[0] if self.by_parity else self.dense_nbytes


class WorkspaceLayout:
    """Offsets of every region; ``nbytes`` is the size of one rank's segment."""

    def __init__(self, world_size: int, max_tokens: int, hidden: int, num_local_experts: int,
                 max_topk: int, dtype: torch.dtype, low_latency: bool = False,
                 rdma: bool = False, ranks_per_node: int | None = None, proxy: bool = False,
                 hierarchical: bool = False, ring_slots: int | None = None,
                 invariant: bool = False):
        R, T, H, L, K = world_size, max_tokens, hidden, num_local_experts, max_topk
        W = T if ring_slots is None else ring_slots
        if not 1 <= W <= T:
            raise ValueError(f"ring_slots must be in [1, max_tokens={T}], got {W}")
        self.ring_slots = W  # staging slots per source and parity of the normal mode
        self.rounds = -(-T // W)  # rounds of a normal-mode call (moe_comm.normal_mode)
        N = ranks_per_node or R
        M = R // N
        self.ranks_per_node, self.num_nodes = N, M
        self.proxy, self.hierarchical = proxy, bool(hierarchical and proxy and M > 1)
        self.world_size, self.max_tokens, self.hidden = R, T, H
        self.num_local_experts, self.max_topk, self.dtype = L, K, dtype
        self.meta_stride = 1 + 3 * K  # int32 words per dispatch slot
        specs = [
            ("signals", (2, R), torch.int64),
            ("tickets", (10,), torch.int64),
            ("epochs", (2,), torch.int64),
            ("stats", (4,), torch.int64),
            ("xstats", (4,), torch.int64),
            ("ft_mask", (R,), torch.int64),
            ("ft_clean", (2, R), torch.int64),
            ("ft_epochs", (R, 4), torch.int64),
            ("dispatch_counts", (PARITIES, R, L + 1), torch.int32),
            ("dispatch_meta", (PARITIES, R, W, self.meta_stride), torch.int32),
            ("dispatch_rows", (PARITIES, R, W, H), dtype),
            ("combine_meta", (PARITIES, R, W, K), torch.float32),
            ("combine_rows", (PARITIES, R, W, H), dtype),
        ]
        self.invariant = invariant
        if invariant:
            specs += [
                ("inv_rows", (PARITIES, W * K, H), dtype),
                ("inv_meta", (PARITIES, W * K, 2), torch.float32),
            ]
        self.low_latency = low_latency
        self.ll_slot_bytes = low_latency_slot_bytes(H, dtype)
        if low_latency:
            specs += [
                ("ll_state", (9,), torch.int64),
                ("ll_dispatch_signals", (PARITIES, L, R), torch.int64),
                ("ll_combine_signals", (PARITIES, R), torch.int64),
                ("ll_acks", (2, PARITIES, R), torch.int64),
                ("ll_dispatch_meta", (PARITIES, L, R, T), torch.int32),
                ("ll_dispatch_rows", (PARITIES, L, R, T, self.ll_slot_bytes), torch.uint8),
                ("ll_combine_rows", (PARITIES, T, K, H), dtype),
            ]
        self.rdma = rdma
        if rdma:  # NVSHMEM puts read from symmetric memory: outboxes of the normal mode
            specs += [
                ("rdma_rows", (PARITIES, W, H * _itemsize(dtype)), torch.uint8),
                ("rdma_meta", (PARITIES, W, self.meta_stride), torch.int32),
                ("rdma_counts", (PARITIES, R, L + 1), torch.int32),
                ("rdma_combine_rows", (PARITIES, R, W, H), dtype),
                ("rdma_combine_meta", (PARITIES, R, W, K), torch.float32),
            ]
        if invariant and proxy:  # (hierarchical too: the invariant combine has no forwarders)
            specs += [
                ("inv_box_rows", (PARITIES, R, W * K, H), dtype),
                ("inv_box_meta", (PARITIES, R, W * K, 2), torch.float32),
            ]
        if proxy:
            row = H * _itemsize(dtype)
            hier = self.hierarchical
            D = M if hier else R
            self.node_meta_stride = self.meta_stride + (N if hier else 0)
            self.px_count_words = N * (L + 1) + 1 if hier else L + 1
            specs += [
                ("px_rows", (PARITIES, D, W, row), torch.uint8),
                ("px_meta", (PARITIES, D, W, self.node_meta_stride), torch.int32),
                ("px_counts", (PARITIES, D, self.px_count_words), torch.int32),
                ("px_combine_rows", (PARITIES, D, W, H), dtype),
                ("px_combine_meta", (PARITIES, D, W, K), torch.float32),
            ]
            if hier:
                specs += [
                    ("node_signals", (2, M), torch.int64),
                    ("fwd_rows", (PARITIES, M, W, row), torch.uint8),
                    ("fwd_meta", (PARITIES, M, W, self.node_meta_stride), torch.int32),
                    ("fwd_counts", (PARITIES, M, self.px_count_words), torch.int32),
                    ("hc_signals", (N,), torch.int64),
                    ("hc_rows", (PARITIES, M, N, W, H), dtype),
                    ("hc_meta", (PARITIES, M, N, W, K), torch.float32),
                    ("hcomb_rows", (PARITIES, M, W, H), dtype),
                    ("hcomb_meta", (PARITIES, M, W, K), torch.float32),
                ]
        # peers without a pointer get the low-latency rows from outboxes (NVSHMEM puts, or the
        # proxy); the proxy copies each pair's meta word from a constant table
        self.ll_outboxes = low_latency and (rdma or proxy)
        if self.ll_outboxes:
            specs += [
                ("ll_outbox", (PARITIES, T, self.ll_slot_bytes), torch.uint8),
                ("ll_combine_outbox", (PARITIES, L, R * T, H), dtype),
            ]
        if low_latency and proxy:
            specs.append(("ll_meta_table", (T, K), torch.int32))
        self.regions: dict[str, Region] = {}
        offset = 0
        for name, shape, dt in specs:
            region = Region(name, offset, shape, dt, by_parity=name in _PARITY_SLICED)
            self.regions[name] = region
            offset += _round_up(region.nbytes, ALIGN_BYTES)
        self.nbytes = offset

    @property
    def staging_bytes(self) -> int:
        """Bytes of the normal mode's staging (dispatch and combine rows and metadata; across
        nodes through the proxy, the outboxes' too, and in hierarchical mode the forwarders';
        across hosts over NVSHMEM, the outboxes the puts read; the EP-invariant combine's
        rows)."""
        names = (STAGING_REGIONS + (OUTBOX_REGIONS if self.proxy else ())
                 + (FORWARDER_REGIONS if self.hierarchical else ())
                 + (RDMA_REGIONS if self.rdma else ())
                 + (INVARIANT_REGIONS if self.invariant else ())
                 + (INVARIANT_OUTBOX_REGIONS if self.invariant and self.proxy else ()))
        return sum(self.regions[n].nbytes for n in names)

    def __getitem__(self, name: str) -> Region:
        return self.regions[name]

    def offset(self, name: str, *index: int) -> int:
        """Byte offset of ``region[index]`` (leading indices): ``offset("dispatch_rows", p, s)``."""
        region = self.regions[name]
        if len(index) > len(region.shape):
            raise IndexError(f"{name} has {len(region.shape)} dims, got index {index}")
        itemsize = _itemsize(region.dtype)
        stride = region.dense_nbytes // itemsize
        elems = 0
        for axis, (i, dim) in enumerate(zip(index, region.shape)):
            if not 0 <= i < dim:
                raise IndexError(f"{name} index {index} out of range for shape {region.shape}")
            stride //= dim
            elems += i * (region.parity_stride // itemsize if axis == 0 and region.by_parity
                          else stride)
        return region.offset + elems * itemsize

    def parity_stride(self, name: str) -> int:
        """Bytes between ``region[0]`` and ``region[1]`` (regions whose first dim is a parity)."""
        return self.regions[name].parity_stride

    def view(self, heap, name: str) -> torch.Tensor:
        """The region as a typed tensor over this rank's segment of ``heap``."""
        region = self.regions[name]
        if not region.by_parity:
            return heap.view(region.offset, region.shape, region.dtype)
        itemsize = _itemsize(region.dtype)
        flat = heap.view(region.offset, (region.nbytes // itemsize,), region.dtype)
        inner = torch.empty(region.shape[1:], device="meta").stride()
        return flat.as_strided(region.shape, (region.parity_stride // itemsize, *inner))

    def internode_plan(self, rank: int) -> dict[str, int]:
        """Byte offsets the internode kernels of ``rank`` use (``kernels.internode``): for each
        region, ``name`` is the offset of its first element (of ``rank``'s slice where a peer's
        copy is addressed), ``name_par`` the bytes per parity, ``name_tgt`` / ``_src`` /
        ``_node`` / ``_local`` the bytes per index of the next dimensions. 0 where the region
        does not exist in this mode."""
        N = self.ranks_per_node
        node, local = divmod(rank, N)
        plan: dict[str, int] = {}

        def put(key: str, region: str, index: tuple, steps: tuple = ()):
            if region not in self.regions:
                return
            plan[key] = self.offset(region, *index)
            plan[key + "_par"] = self.parity_stride(region)
            for suffix, axis in steps:
                r = self.regions[region]
                inner = _itemsize(r.dtype)
                for dim in r.shape[axis + 1:]:
                    inner *= dim
                plan[f"{key}_{suffix}"] = inner

        hier = self.hierarchical
        put("px_rows", "px_rows", (0, 0), (("tgt", 1),))
        put("px_meta", "px_meta", (0, 0), (("tgt", 1),))
        put("px_counts", "px_counts", (0, 0), (("tgt", 1),))
        put("dst_rows", "fwd_rows" if hier else "dispatch_rows", (0, node if hier else rank))
        put("dst_meta", "fwd_meta" if hier else "dispatch_meta", (0, node if hier else rank))
        put("dst_counts", "fwd_counts" if hier else "dispatch_counts",
            (0, node if hier else rank))
        if "px_rows" in self.regions:
            plan["dst_signal"] = (self.offset("node_signals", 0, node) if hier
                                  else self.offset("signals", 0, rank))
            plan["comb_signal"] = self.offset("signals", 1, rank)
        put("pxc_rows", "px_combine_rows", (0, 0), (("tgt", 1),))
        put("pxc_meta", "px_combine_meta", (0, 0), (("tgt", 1),))
        put("hc_rows", "hc_rows", (0, 0, 0), (("node", 1), ("local", 2)))
        put("hc_meta", "hc_meta", (0, 0, 0), (("node", 1), ("local", 2)))
        if hier:
            plan["hc_signals"] = self.offset("hc_signals", 0)
        put("hcomb_rows", "hcomb_rows", (0, node))
        put("hcomb_meta", "hcomb_meta", (0, node))
        put("d_rows", "dispatch_rows", (0, 0), (("src", 1),))
        put("d_meta", "dispatch_meta", (0, 0), (("src", 1),))
        put("d_counts", "dispatch_counts", (0, 0), (("src", 1),))
        plan["d_signals"] = self.offset("signals", 0, 0)
        put("fwd_rows", "fwd_rows", (0, 0), (("src", 1),))
        put("fwd_meta", "fwd_meta", (0, 0), (("src", 1),))
        put("fwd_counts", "fwd_counts", (0, 0), (("src", 1),))
        put("comb_rows", "combine_rows", (0, rank))
        put("comb_meta", "combine_meta", (0, rank))
        return plan

    def describe(self) -> str:
        """One line per region: name, shape, dtype, bytes; then the total."""
        lines = [f"{r.name:<16} {str(list(r.shape)):<24} {str(r.dtype):<16} {r.nbytes:>14,d} B"
                 for r in self.regions.values()]
        lines.append(f"{'total':<16} {'':<24} {'':<16} {self.nbytes:>14,d} B")
        return "\n".join(lines)
