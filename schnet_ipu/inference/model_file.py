"""A trained model is a file: a checkpoint rebuilds and runs its model with no data set.

    trained = load_trained("runs/qm9/checkpoints/best.pt")   # or the run folder
    energy = trained.model(batch)                             # SchNet with its weights, CPU

Every checkpoint holds ``model_spec`` (:class:`ModelSpec`, plain data beside the weights):
the model's constructor arguments (the ``model`` config section as trained, op flavour
included, plus the atoms per pack and the output scale), the task's parameters (the target
transform: atom references and loss scale), the unit, the pack limits, and the elements seen
in training. Loading stays ``weights_only``: nothing in a model file can run code.

Checkpoints written before model files existed have no spec: they are refused with one line
(export them with the release that wrote them, or retrain).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from schnet_ipu.checkpoint import load_checkpoint, load_model_state, restoring
from schnet_ipu.config import ConfigError, ModelConfig
from schnet_ipu.errors import CheckpointError
from schnet_ipu.model import SchNet
from schnet_ipu.model.schnet import EMBEDDING_ROWS
from schnet_ipu.task import TargetTransform, task_from_dict

SPEC_VERSION = 1


@dataclass
class ModelSpec:
    """What rebuilds and uses a trained model (see the module docstring)."""

    model: dict[str, Any]  # ModelConfig fields as trained (ops: the flavour that trained it)
    max_nodes_per_pack: int  # M: atoms per training pack (knn and dense graphs search per pack)
    mean: float  # per-atom output = h * std + mean
    std: float
    task: dict[str, Any]  # Task.to_dict(): kind, target transform, loss parameters
    unit: str  # of the energy (the store's target unit)
    forces_unit: str
    target: str  # the store's target name
    pack: dict[str, Any]  # max_nodes, max_graphs, max_edges (None for knn), packs_per_batch
    elements: list[int] = field(default_factory=list)  # atomic numbers seen in training
    version: int = SPEC_VERSION

    @property
    def transform(self) -> TargetTransform:
        return task_from_dict(self.task).transform

    @property
    def cutoff(self) -> float:
        return float(self.model["cutoff"])

    def build_model(self) -> SchNet:
        """SchNet with this spec's architecture (weights as initialised; load them next)."""
        return SchNet.from_config(
            ModelConfig(**self.model),
            max_nodes_per_pack=self.max_nodes_per_pack,
            mean=self.mean,
            std=self.std,
            atomref=torch.zeros(EMBEDDING_ROWS),  # the trained reference is in the weights
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any, where: Path) -> ModelSpec:
        if not isinstance(raw, dict) or raw.get("version") != SPEC_VERSION:
            version = raw.get("version") if isinstance(raw, dict) else None
            raise CheckpointError(
                f"{where}: model_spec version {version!r}, this program reads version "
                f"{SPEC_VERSION}; use the schnet-ipu release that wrote it"
            )
        try:
            spec = cls(**raw)
            if "filter" not in spec.model:  # written before tabulated filters: trained exact
                spec.model = {**spec.model, "filter": "exact"}
            ModelConfig(**spec.model)
        except TypeError as err:
            raise CheckpointError(f"{where}: damaged model_spec ({err})") from err
        return spec

    def check_elements(self, z: np.ndarray, where: str) -> None:
        """Refuse, by name, an element the model never saw in training."""
        unseen = sorted(set(np.unique(z).tolist()) - set(self.elements))
        if unseen:
            raise ConfigError(
                f"{where}: element(s) {', '.join(map(str, unseen))} never seen in training "
                f"(the model knows {', '.join(map(str, self.elements))}); its predictions "
                "for them would be meaningless"
            )


@dataclass
class TrainedModel:
    """A checkpoint's model (eval mode, CPU, float32), its spec and where it came from."""

    model: SchNet
    spec: ModelSpec
    path: Path
    config: dict[str, Any]  # the training config (provenance; not needed to run the model)


def checkpoint_path(path: str | Path, checkpoint: str = "best") -> Path:
    """A model file, or the ``checkpoint`` ("best" or "last") of a run folder."""
    path = Path(path)
    if path.is_dir():
        path = path / "checkpoints" / f"{checkpoint}.pt"
        if not path.is_file():
            raise CheckpointError(f"{path.parent.parent} has no {checkpoint} checkpoint ({path})")
    elif not path.exists():
        raise CheckpointError(f"{path}: no such model file or run folder")
    return path


def load_trained(path: str | Path, checkpoint: str = "best") -> TrainedModel:
    """The model of a checkpoint file or run folder, ready to predict (see the module doc)."""
    path = checkpoint_path(path, checkpoint)
    state = load_checkpoint(path)
    if "model_spec" not in state:
        raise CheckpointError(
            f"{path} predates self-contained model files (it holds no model_spec); export it "
            "with the schnet-ipu release that wrote it (train.py export: a TorchScript file "
            "any torch program runs), or retrain"
        )
    spec = ModelSpec.from_dict(state["model_spec"], path)
    model = spec.build_model()
    with restoring(path):
        load_model_state(model, state["model"])
    return TrainedModel(model.eval(), spec, path, state["config"])
