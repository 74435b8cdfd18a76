"""Training molecules/s on QM9: ours (the real pipeline, packed and pad-to-max) against stock
PyG SchNet, the same model size, loss and molecules, about ``batch_molecules`` per step; and
the shipped QM9 recipe as it trains (:data:`schnet_ipu.recipes.RECIPES` ``energies``: two
compiled replicas of 16 packs, the 128-point table, bf16 where the CPU multiplies it), its
molecules per step its own. Every variant is timed in interleaved rounds (:mod:`.common`).
The committed report: docs/benchmarks/throughput/; its figures, with the machine they were
measured on: docs/benchmarks/README.md."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from schnet_ipu.bench import common, pyg
from schnet_ipu.bench.replicas import Replicas
from schnet_ipu.config import ModelConfig
from schnet_ipu.recipes import RECIPES
from schnet_ipu.training.data import PreparedData

PACKED = {"packed radius+tuple": ("radius", "tuple"), "packed knn+lpfhp": ("knn", "lpfhp")}
COMPILED = " compiled"  # name suffix of variants whose step runs through torch.compile
TABLE = " filter=table"  # name suffix of variants with the tabulated filter (model.filter)
FILTERS = {"exact": "", "table": TABLE}  # model.filter -> name suffix
REPLICAS = 2  # processes of the replicated variants
RECIPE = "qm9 recipe"  # the shipped recipe's step; its keys come from the recipe's table
RECIPE_KEYS = ("model.", "packing.", "backend.compile", "backend.precision")
COLUMNS = ["name", "molecules_per_s", "step_ms", "molecules_per_step", "replicas",
           "threads_per_replica", "atoms_per_step", "node_efficiency", "edge_efficiency",
           "graph"]  # fmt: skip
PLOT = ("name", "molecules_per_s", "training molecules/s")
QUICK = {"sample": 3000, "timing": common.Timing(warmup=2, steps=4, repeats=9),
         "padded": ("radius",)}  # fmt: skip


def ours(
    store: str | Path, sample: int, size: ModelConfig, overrides: list[str],
    batch_molecules: int | None = 32, replicas: int = 1,
) -> tuple[dict, PreparedData, Callable[[], int]]:  # fmt: skip
    """One of our configurations (:func:`.common.our_trainer`): its facts, data and step."""
    trainer = common.our_trainer(store, sample, size, overrides, batch_molecules, replicas)
    cfg, data, loader, backend = trainer
    plan, packs = data.train_plan, cfg.packing.packs_per_batch
    row = {"replicas": replicas, "threads_per_replica": torch.get_num_threads(),
           "atoms_per_step": replicas * packs * plan.max_nodes, "packs_per_batch": packs,
           "max_nodes": plan.max_nodes, "max_edges": plan.max_edges,
           "max_graphs": plan.max_graphs, "node_efficiency": plan.node_efficiency,
           "edge_efficiency": plan.edge_efficiency, "workers": cfg.loader.workers}  # fmt: skip
    return row, data, common.training_step(loader, backend)


def replica_setup(rank: int, world: int, setups: dict[str, tuple]) -> tuple[dict, dict]:
    """Every replicated variant in one replica (``setups``: name -> :func:`ours`' arguments)."""
    facts, calls = {}, {}
    for name, setup in setups.items():
        facts[name], _, calls[name] = ours(*setup, replicas=world)
    return facts, calls


def variants(padded: tuple[str, ...], compile: bool) -> list[tuple]:
    """(name, graph, packing, compiled, filter, replicas) of every variant of ours."""
    rows = [(name + suffix, graph, packing, False, filter_, 1)
            for filter_, suffix in FILTERS.items()
            for name, (graph, packing) in PACKED.items()]  # fmt: skip
    rows += [(f"pad_to_max {g}", g, "pad_to_max", False, "exact", 1) for g in padded]
    if compile:
        rows.append(("packed radius+tuple" + COMPILED, "radius", "tuple", True, "exact", 1))
        rows.append(("pad_to_max radius" + COMPILED, "radius", "pad_to_max", True, "exact", 1))
        rows.append(("packed radius+tuple" + TABLE + COMPILED, "radius", "tuple", True, "table", 1))
    name, compiled = f"packed radius+tuple {REPLICAS} replicas", COMPILED if compile else ""
    rows += [(name + suffix + compiled, "radius", "tuple", compile, filter_, REPLICAS)
             for filter_, suffix in FILTERS.items()]  # fmt: skip
    return [*rows, (RECIPE, "radius", "tuple", True, "table", REPLICAS)] if compile else rows


def recipe_overrides() -> list[str]:
    """The energies recipe's model, packing, compile and precision keys, as overrides."""
    recipe = RECIPES["energies"]
    return [f"{key}={value}" for key, value in recipe.items() if key.startswith(RECIPE_KEYS)]


def run(
    store: str | Path = common.QM9_STORE, sample: int = 10000,
    size: ModelConfig = common.PAPER_SIZE, timing: common.Timing | None = None, workers: int = 0,
    batch_molecules: int = 32, padded: tuple[str, ...] = ("radius", "knn"), compile: bool = True,
) -> dict:  # fmt: skip
    """Every variant side by side (``compile``: ``torch.compile`` twins, PyG stays eager)."""
    timing = timing or common.Timing(warmup=5, steps=10, repeats=10)
    results: dict[str, dict] = {}
    steps: dict[str, Callable[[], int]] = {}
    data, replicated = None, {}
    for name, graph, packing, compiled, filter_, count in variants(padded, compile):
        setup = [f"model.graph={graph}", f"packing.algorithm={packing}",
                 "model.pair_symmetric=true", f"loader.workers={workers}",
                 f"backend.compile={compiled}", f"model.filter={filter_}"]  # fmt: skip
        if name == RECIPE:  # its own packs per step and precision, as configs/qm9.yaml trains
            replicated[name] = (store, sample, size, [*setup, *recipe_overrides()], None)
            continue
        if count > 1:  # in the replica group, once every in-process variant is set up
            replicated[name] = (store, sample, size, setup, batch_molecules)
            continue
        row, data, steps[name] = ours(store, sample, size, setup, batch_molecules)
        results[name] = {"name": name, "graph": graph, "packing": packing, **row}
    steps[pyg.NAME] = pyg.Trainer(data, size, batch_molecules).step
    results[pyg.NAME] = {"name": pyg.NAME, "graph": f"radius ({pyg.RADIUS_BUILDER})",
                         "packing": "PyG DataLoader", "workers": 0, "replicas": 1,
                         "threads_per_replica": torch.get_num_threads()}  # fmt: skip
    with Replicas(REPLICAS, replica_setup, replicated) as group:
        for name in replicated:
            steps[name] = group.step(name)
            results[name] = {"name": name, "graph": "radius", "packing": "tuple",
                             **group.facts[0][name]}  # fmt: skip
        measured = common.measure_side_by_side(steps, timing)
    for name, rate in measured.items():
        results[name].update(molecules_per_s=rate.molecules_per_s,
                             step_ms=1000 * rate.step_seconds,
                             molecules_per_step=rate.molecules_per_step,
                             repeats_molecules_per_s=rate.repeats)  # fmt: skip
    notes = [
        f"{len(data.split['train'])} QM9 training molecules (fixed sample), about "
        f"{batch_molecules} per optimiser step (packs hold whole molecules: ours 33-35), Adam "
        "1e-3 (ours fused, PyG torch's default), standardised MSE; both hold the molecules in "
        f"memory. SchNet {size.hidden_channels}/{size.num_interactions}/{size.num_gaussians}, "
        f"cutoff {size.cutoff}, knn k={size.k}; ours {workers} loader thread(s). "
        f"{RECIPE!r}: {' '.join(recipe_overrides())}, {REPLICAS} replicas (its own molecules "
        "per step; the loss and the learning rate as the others).",
        f"common.Timing: {timing.warmup} warm-up steps, then {timing.repeats} rounds of "
        f"{timing.steps} steps of each variant in turn; medians (*_per_round: each round's).",
    ]
    return common.new_report("throughput", list(results.values()), compare(results), notes)


def compare(results: dict[str, dict]) -> dict:
    """Best packed (and in one process) over PyG and padding; each over PyG and its twin."""
    rate = {name: row["molecules_per_s"] for name, row in results.items()}
    packed = [name for name in rate if name.startswith("packed")]
    exact = [name for name in packed if TABLE not in name]
    best = max(packed, key=rate.get)
    single = max((n for n in packed if results[n].get("replicas", 1) == 1), key=rate.get)
    # the fairest padded reference: the fastest pad-to-max run of the same graph, compiled
    # or not (compiling does not always pay for padded batches), else the fastest padded one
    padded_runs = [name for name in rate if name.startswith("pad_to_max")]
    same_graph = [n for n in padded_runs if results[n]["graph"] == results[single]["graph"]]
    reference = max(same_graph or padded_runs, key=rate.get)
    ratios = {"best_exact": max(exact, key=rate.get),
              "best_exact_vs_pyg": common.ratio(max(rate[n] for n in exact), rate[pyg.NAME]),
              "best_packed": best, "best_single_process": single,
              "padded_reference": reference}  # fmt: skip
    pairs = {"packed_vs_pyg": (best, pyg.NAME), "single_process_vs_pyg": (single, pyg.NAME),
             "packed_vs_padded": (single, reference)}  # fmt: skip
    if RECIPE in rate:
        pairs["recipe_vs_pyg"] = (RECIPE, pyg.NAME)
    ratios.update({key: common.ratio(rate[a], rate[b]) for key, (a, b) in pairs.items()})
    rounds = {name: row["repeats_molecules_per_s"] for name, row in results.items()}
    for key, (mine, other) in pairs.items():
        ratios[f"{key}_per_round"] = [a / b for a, b in zip(rounds[mine], rounds[other])]
    for name in packed:
        key = name[len("packed ") :].replace("+", "_").replace(" ", "_")
        ratios[f"{key}_vs_pyg"] = common.ratio(rate[name], rate[pyg.NAME])
        twin = name.replace("packed", "pad_to_max", 1).replace("+tuple", "").replace("+lpfhp", "")
        if twin in rate:
            ratios[f"{key}_vs_{twin.replace(' ', '_')}"] = common.ratio(rate[name], rate[twin])
    return ratios
