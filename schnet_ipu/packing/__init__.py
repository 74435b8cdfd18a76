"""Packing molecules into fixed-capacity packs: LPFHP, tuple packing, baselines, search.

The loader and trainer use :func:`plan_packing` once and :func:`assign_packs` per epoch.
"""

from schnet_ipu.packing.plan import (
    PackingError,
    PackPlan,
    assign_packs,
    assign_packs_flat,
    plan_packing,
)

__all__ = ["PackPlan", "PackingError", "assign_packs", "assign_packs_flat", "plan_packing"]
