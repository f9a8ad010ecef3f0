"""moe_comm: expert-parallel MoE dispatch and combine over symmetric memory.

    buf = moe_comm.Buffer(group, hidden=H, num_experts=E, max_tokens_per_rank=T_max,
                          dtype=torch.bfloat16)
    res = buf.dispatch(x, topk_idx, topk_weights)      # rows grouped by local expert
    out = buf.combine(expert_fn(res.x), res.handle, weights=res.weights)

Without a GPU the kernels run under the Triton interpreter: importing moe_comm sets
``TRITON_INTERPRET=1`` when no CUDA device is present and the variable is unset (it must be set
before the kernels are defined).
"""
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from . import ll_ops, reference, testing  # noqa: E402  (ll_ops: the low-latency custom ops)
from .buffer import Buffer  # noqa: E402
from .call_descriptor import PeerInputError  # noqa: E402
from .kernels.comm import PeerTimeoutError  # noqa: E402
from .transport import TransportError  # noqa: E402
from .types import DispatchHandle, DispatchResult  # noqa: E402

__all__ = ["Buffer", "DispatchResult", "DispatchHandle", "PeerInputError", "PeerTimeoutError",
           "TransportError", "ll_ops", "reference", "testing"]
__version__ = "0.1.0"
