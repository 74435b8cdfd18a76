"""Op flavours: the primitives SchNet is built from, one module per kind of hardware.

The model calls only the primitives of :class:`~.interface.Ops` (the Protocol every flavour
conforms to: softplus, gather, scatter, the pair-symmetric and tabulated convolutions, the
knn search, edge lengths and periodic cell offsets), through the flavour object it was built
with (``model.ops``), so choosing a flavour never touches the model file.

Flavours: ``torch`` (:mod:`.torch_ops`: fused kernels, custom autograd, in-place buffers) for
CPU and CUDA; ``ipu`` (:mod:`.ipu_ops`: only ops PopTorch maps to Poplar) for the IPU and its
CPU emulation; ``triton`` (:mod:`.triton_ops`: the torch flavour with fused Triton kernels for
the message passing) for CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

from schnet_ipu.model.ops.common import naive_shifted_softplus
from schnet_ipu.model.ops.interface import Ops
from schnet_ipu.model.ops.ipu_ops import IpuOps
from schnet_ipu.model.ops.torch_ops import TorchOps
from schnet_ipu.model.ops.triton_ops import TritonOps

FLAVOURS: dict[str, Callable[[], Ops]] = {"torch": TorchOps, "ipu": IpuOps, "triton": TritonOps}

__all__ = [
    "FLAVOURS",
    "IpuOps",
    "Ops",
    "TorchOps",
    "TritonOps",
    "get_ops",
    "naive_shifted_softplus",
]


def get_ops(name: str) -> Ops:
    """The flavour called ``name`` ("torch", "ipu" or "triton")."""
    if name not in FLAVOURS:
        raise ValueError(f"unknown op flavour {name!r}; one of {', '.join(FLAVOURS)}")
    return FLAVOURS[name]()
