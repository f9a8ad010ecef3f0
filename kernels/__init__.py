"""Triton kernels of moe_comm, installed as ``moe_comm.kernels``.

``comm``: device primitives (peer pointers, signals) and the bounded host-side wait;
``layout``: routing layout; ``dispatch``: send and expand; ``combine``: send and reduce.
Every module exposes ``@triton.jit`` kernels plus a host launcher per kernel; launchers check
nothing (the torch API validates inputs before any launch) and return nothing.
"""

from . import interpreter as _interpreter

_interpreter.install()  # CPU ranks: helper calls inside a launch do not re-patch triton.language
