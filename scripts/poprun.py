"""Build (and optionally run) the ``poprun`` command for a multi-host IPU-POD training run.

    python scripts/poprun.py --config configs/qm9.yaml backend.replicas=16 \\
        --instances 4 --hosts pod-a,pod-b --partition p16 --vipu-server-host pod-a [--exec]

PopRun starts ``--instances`` copies of ``train.py`` across the hosts; each drives
replicas / instances replicas of ``--ipus-per-replica`` IPUs and learns its instance index
through popdist (read in ``schnet_ipu.backends.distributed``). The config is loaded and
validated here first, so a bad key fails before any IPU is reserved.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from schnet_ipu.config import ConfigError, load_config  # noqa: E402 (after the path setup)


def poprun_command(args: argparse.Namespace) -> list[str]:
    """The poprun argv for the parsed arguments (config included)."""
    cfg = load_config(args.config, args.overrides)
    replicas, instances = cfg.backend.replicas, args.instances
    if cfg.backend.device != "ipu":
        raise ConfigError(
            f"poprun runs on IPU-PODs: set backend.device=ipu, not {cfg.backend.device}"
        )
    if replicas % instances:
        raise ConfigError(
            f"backend.replicas={replicas} must be a multiple of --instances={instances} "
            "(each instance drives the same number of replicas)"
        )
    hosts = [h for h in args.hosts.split(",") if h]
    if hosts and instances % len(hosts):
        raise ConfigError(f"--instances={instances} must spread evenly over {len(hosts)} hosts")
    command = [
        "poprun",
        "-vv",
        f"--num-instances={instances}",
        f"--num-replicas={replicas}",
        f"--ipus-per-replica={args.ipus_per_replica}",
        "--numa-aware=yes",
        f"--only-output-from-instance={args.output_from}",
    ]
    if hosts:
        command.append(f"--host={','.join(hosts)}")
    if args.partition:
        command += [
            f"--vipu-partition={args.partition}",
            "--update-partition=yes",
            "--reset-partition=no",
        ]
    if args.vipu_server_host:
        command.append(f"--vipu-server-host={args.vipu_server_host}")
    if args.executable_cache:
        command.append(f"--executable-cache-path={args.executable_cache}")
    if len(hosts) > 1:  # forward the environment PopTorch needs to every host
        command.append(
            "--mpi-local-args=-x LD_LIBRARY_PATH -x PATH -x PYTHONPATH -x POPLAR_SDK_ENABLED"
        )
    program = [sys.executable if args.python is None else args.python, str(REPO / "train.py")]
    if args.config is not None:
        program += ["--config", str(args.config)]
    return command + program + list(args.overrides)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="YAML config for train.py")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for train.py")
    parser.add_argument("--instances", type=int, default=1, help="host processes (poprun)")
    parser.add_argument("--ipus-per-replica", type=int, default=1)
    parser.add_argument("--hosts", default="", help="comma-separated host names")
    parser.add_argument("--partition", default="", help="V-IPU partition name")
    parser.add_argument("--vipu-server-host", default="", help="V-IPU controller host")
    parser.add_argument("--executable-cache", default="", help="shared Poplar executable cache")
    parser.add_argument("--output-from", type=int, default=0, help="instance whose output shows")
    parser.add_argument("--python", help="interpreter on the hosts (default: this one)")
    parser.add_argument("--exec", action="store_true", help="run the command, not just print it")
    args = parser.parse_args(argv)
    if args.instances < 1 or args.ipus_per_replica < 1:
        parser.error("--instances and --ipus-per-replica must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        command = poprun_command(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(shlex.join(command))
    if not args.exec:
        return 0
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
