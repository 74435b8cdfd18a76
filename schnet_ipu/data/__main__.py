"""CLI: import datasets into stores and print their size statistics.

python -m schnet_ipu.data import qm9 --out data/qm9.h5 [--limit N]
python -m schnet_ipu.data import qm9-raw --raw-dir D --out data/qm9.h5
python -m schnet_ipu.data import hydronet --raw-dir D --subset small --out data/hydronet.h5
python -m schnet_ipu.data import water --clusters N --sizes 3 30 --seed 0 --out data/water.h5
python -m schnet_ipu.data import water --clusters 4464740 --templates 16 --distribution hydronet \
    --out data/water_4m5.h5
python -m schnet_ipu.data stats data/qm9.h5 --cutoff 6 [--png PATH]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

from schnet_ipu.errors import positive_float, run_cli

from .checks import StoreError
from .hydronet import import_hydronet
from .pairs import edge_counts
from .qm9 import import_qm9, import_qm9_raw
from .store import MoleculeStore
from .water import generate_water
from .water_sampled import generate_water_sampled, hydronet_weights


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m schnet_ipu.data", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("import", help="import a dataset into an HDF5 store")
    imp.add_argument("source", choices=("qm9", "qm9-raw", "hydronet", "water"))
    imp.add_argument("--out", required=True, type=Path)
    imp.add_argument("--limit", type=int, default=None, help="qm9: first N molecules only")
    imp.add_argument("--raw-dir", type=Path, help="qm9-raw, hydronet: folder of raw files")
    imp.add_argument("--subset", default="small", choices=("small", "medium", "large"))
    imp.add_argument("--clusters", type=int, default=2000, help="water: number of clusters")
    imp.add_argument("--sizes", type=int, nargs=2, default=(3, 30), metavar=("MIN", "MAX"))
    imp.add_argument("--seed", type=int, default=0)
    imp.add_argument(
        "--skip-invalid",
        action="store_true",
        help="qm9, qm9-raw: drop and list records with unknown elements or non-finite values "
        "(else refuse)",
    )
    imp.add_argument(
        "--templates", type=int, default=0, help="water: sample around N relaxed per size"
    )
    imp.add_argument("--distribution", default="uniform", choices=("uniform", "hydronet"))
    stats = commands.add_parser("stats", help="node and edge histograms of a store")
    stats.add_argument("store", type=Path)
    stats.add_argument("--cutoff", type=positive_float, default=6.0)
    stats.add_argument("--png", type=Path, default=None, help="default: <store>.stats.png")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "import":
        return run_cli(lambda: run_import(args))
    return run_cli(lambda: print_stats(args.store, args.cutoff, args.png))


def run_import(args: argparse.Namespace) -> None:
    if args.source in ("qm9-raw", "hydronet") and args.raw_dir is None:
        raise StoreError(f"import {args.source} needs --raw-dir")
    if args.skip_invalid and args.source not in ("qm9", "qm9-raw"):
        raise StoreError(
            f"--skip-invalid applies to qm9 and qm9-raw imports; {args.source} streams its "
            "records and refuses a bad one, naming it"
        )
    start = time.perf_counter()
    if args.source == "qm9":
        import_qm9(args.out, limit=args.limit, skip_invalid=args.skip_invalid)
    elif args.source == "qm9-raw":
        import_qm9_raw(args.raw_dir, args.out, skip_invalid=args.skip_invalid)
    elif args.source == "hydronet":
        import_hydronet(args.raw_dir, args.out, args.subset, seed=args.seed)
    elif args.templates:
        generate_water_sampled(
            args.out, args.clusters, args.sizes, args.seed, args.templates, args.distribution
        )
    else:
        weights = None
        if args.distribution == "hydronet":
            weights = [
                hydronet_weights().get(w, 0.0) for w in range(args.sizes[0], args.sizes[1] + 1)
            ]
        generate_water(args.out, args.clusters, args.sizes, seed=args.seed, weights=weights)
    store = MoleculeStore(args.out)
    print(
        f"{args.out}: {len(store)} molecules, {int(store.num_atoms.sum())} atoms, "
        f"{args.out.stat().st_size / 1e6:.1f} MB, {time.perf_counter() - start:.1f} s"
    )
    skipped = store.attrs.get("skipped_records")
    if skipped is not None:
        ids = ", ".join(str(int(i)) for i in np.atleast_1d(skipped))
        print(f"skipped {np.size(skipped)} invalid record(s) (ids {ids}); see the warnings above")


def histogram_lines(values: np.ndarray, bins: int = 20, width: int = 50) -> list[str]:
    """A text histogram of integer ``values`` [M]: one line per bin with a bar."""
    counts, edges = np.histogram(values, bins=min(bins, int(values.max() - values.min()) + 1))
    scale = width / max(counts.max(), 1)
    return [
        f"  {lo:8.1f} - {hi:8.1f} | {'#' * round(c * scale):<{width}} {c}"
        for lo, hi, c in zip(edges[:-1], edges[1:], counts)  # equal lengths (Python 3.8)
    ]


def print_stats(path: Path, cutoff: float, png: Path | None) -> None:
    store = MoleculeStore(path)
    nodes = store.num_atoms
    edges = edge_counts(store, cutoff)
    pairs = nodes * (nodes - 1)
    sparsity = 1 - edges.sum() / max(pairs.sum(), 1)
    print(f"{path}: {len(store)} molecules, source {store.attrs.get('source')}")
    print(f"nodes per molecule: min {nodes.min()}, mean {nodes.mean():.2f}, max {nodes.max()}")
    print("\n".join(histogram_lines(nodes)))
    print(
        f"directed edges per molecule (cutoff {cutoff:g} A): min {edges.min()}, "
        f"mean {edges.mean():.2f}, max {edges.max()}"
    )
    print("\n".join(histogram_lines(edges)))
    print(
        f"sparsity: {sparsity:.4f} of the n(n-1) ordered pairs are beyond the cutoff; "
        f"edges per node {edges.sum() / nodes.sum():.2f}"
    )
    png = png or path.with_name(f"{path.name}.stats.png")
    save_png(nodes, edges, cutoff, png, title=path.name)
    print(f"saved {png}")


def save_png(nodes: np.ndarray, edges: np.ndarray, cutoff: float, png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.hist(nodes, bins=np.arange(nodes.min(), nodes.max() + 2) - 0.5)
    left.set(xlabel="atoms per molecule", ylabel="molecules", title=title)
    right.hist(edges, bins=50)
    right.set(xlabel=f"directed edges per molecule (cutoff {cutoff:g} A)", ylabel="molecules")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
