"""Packing molecules into fixed-capacity packs: LPFHP, tuple packing, baselines, search.

The loader and trainer use :func:`plan_packing` once and :func:`assign_packs` (or
:class:`PackSlots`, worked out once, then drawn) per epoch.
"""

from schnet_ipu.packing.plan import (
    PackingError,
    PackPlan,
    PackSlots,
    assign_packs,
    plan_packing,
)

__all__ = ["PackPlan", "PackSlots", "PackingError", "assign_packs", "plan_packing"]
