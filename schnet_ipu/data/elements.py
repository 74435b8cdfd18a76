"""The periodic table as the store uses it: symbols indexed by atomic number 0..118.

``NUM_ELEMENTS`` (119) is the one count of atomic numbers in the data path: per-element
tables (atom references, element counts) are indexed by atomic number, 0 the padding atom.
(The model's embedding has its own, smaller row count: :mod:`schnet_ipu.model`.)
"""

from __future__ import annotations

import numpy as np

_SYMBOLS = (
    "H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge "
    "As Se Br Kr Rb Sr Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm "
    "Eu Gd Tb Dy Ho Er Tm Yb Lu Hf Ta W Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U "
    "Np Pu Am Cm Bk Cf Es Fm Md No Lr Rf Db Sg Bh Hs Mt Ds Rg Cn Nh Fl Mc Lv Ts Og"
)
# Index = atomic number; "" at 0 so that ELEMENTS[z] is the symbol of z.
ELEMENTS: tuple[str, ...] = ("", *_SYMBOLS.split())
ATOMIC_NUMBER: dict[str, int] = {s: i for i, s in enumerate(ELEMENTS) if s}
NUM_ELEMENTS = len(ELEMENTS)  # 119: atomic numbers 0..118


def atomic_numbers(labels: np.ndarray) -> np.ndarray:
    """Element symbols or numbers [A] -> int64 atomic numbers [A]; 0 for an unknown symbol
    or a non-integral number (the store's checks report those as unknown elements)."""
    if labels.dtype.kind in "USO":
        symbols, inverse = np.unique(labels.astype(str), return_inverse=True)
        known = np.array([ATOMIC_NUMBER.get(s.strip(), 0) for s in symbols], dtype=np.int64)
        return known[inverse]
    numbers = np.where(np.isfinite(labels), labels, 0).astype(np.int64)
    return np.where(numbers == labels, numbers, 0)
