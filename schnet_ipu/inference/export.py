"""A trained model as one TorchScript file: ``train.py export``.

export_model("runs/a", Path("a.torchscript.pt"))   # for LAMMPS, OpenMM-Torch, libtorch
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from schnet_ipu.files import check_output
from schnet_ipu.inference.model_file import checkpoint_path, load_trained
from schnet_ipu.inference.portable import PortableSchNet


def export_model(
    model: str | Path, out: Path, checkpoint: str = "best", dtype: torch.dtype = torch.float32
) -> dict:
    """Write a checkpoint's model as a TorchScript file that plain torch loads
    (``torch.jit.load``) with no import of this package; returns its metadata, which the
    file also holds as ``schnet_ipu.json`` (``_extra_files``). Its interface is
    :class:`~schnet_ipu.inference.portable.PortableSchNet`'s: ``model(z, pos)`` for molecules,
    ``model(z, pos, cell, pbc)`` for cells (the neighbour search in torch ops inside the
    file), ``model.forward_edges(z, pos, edge_index, offsets, full_list)`` for an engine's
    own neighbour list; float32 or float64 inputs whatever ``dtype``.

    ``out`` may not be a folder or the checkpoint it reads (one line, nothing written).

    TorchScript, not ``torch.export``: the forces are an autograd pass over a neighbour list
    whose length depends on the positions, and ``torch.export`` in torch 2.13 stops on that
    data-dependent size inside the backward (GuardOnDataDependentSymNode); TorchScript keeps
    both, and is what the OpenMM-Torch and LAMMPS plugins load today.
    """
    source = checkpoint_path(model, checkpoint)
    # a run's checkpoints are one set: exporting best.pt onto last.pt loses the resume point
    siblings = [source.with_name(name) for name in ("best.pt", "last.pt")]
    run_files = siblings if source.parent.name == "checkpoints" else []
    check_output(out, [("checkpoint", source), *(("run's checkpoint", p) for p in run_files)])
    trained = load_trained(source)
    module = PortableSchNet.from_trained(trained, dtype)
    with warnings.catch_warnings():  # TorchScript's deprecation notice: chosen knowingly
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(module)
    meta = {
        "interface": "energy, forces = model(z, pos); "
        "energy, forces, stress = model(z, pos, cell, pbc); "
        "energy, forces, virial = model.forward_edges(z, pos, edge_index, offsets, full_list)",
        "z": "int [N] atomic numbers",
        "pos": "float32 or float64 [N, 3] Angstrom",
        "cell": "[3, 3] Angstrom, rows the lattice vectors; pbc: bool [3] (default all True)",
        "edge_index": "int [2, E] rows (i, j): edge vector pos[j] - pos[i] + offsets[e]",
        "offsets": "[E, 3] Angstrom; full_list: True if every pair is listed both ways",
        "energy": f"float64 [] {trained.spec.unit}",
        "forces": f"[N, 3] {trained.spec.forces_unit}, pos's dtype",
        "stress": f"[3, 3] {trained.spec.unit}/Angstrom^3 = (1/V) dE/dstrain (ASE's sign)",
        "virial": f"[3, 3] {trained.spec.unit} = -dE/dstrain = -V stress",
        "precision": str(dtype).replace("torch.", ""),
        "filter": trained.spec.model.get("filter", "exact"),
        "cutoff": trained.spec.cutoff,
        "elements": trained.spec.elements,
        "source": str(trained.path),
        "model_spec": trained.spec.to_dict(),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            extra = {"schnet_ipu.json": json.dumps(meta)}
            torch.jit.save(scripted, str(tmp), _extra_files=extra)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)  # a failed write leaves nothing behind
    return meta
