"""Build (and optionally run) the ``poprun`` command for a multi-host IPU-POD training run.

    python scripts/poprun.py --config configs/qm9.yaml backend.replicas=16 \\
        --instances 4 --hosts pod-a,pod-b --partition p16 --vipu-server-host pod-a [--exec]
    python scripts/poprun.py --config configs/qm9.yaml backend.replicas=16 --instances 4 \\
        --slurm-script job.sh --nodes 2   # then: sbatch job.sh

PopRun starts ``--instances`` copies of ``train.py`` across the hosts; each drives
replicas / instances replicas of one IPU each and learns its instance index through popdist
(read in ``schnet_ipu.backends.distributed``). The instances also join a gloo process group
(evaluation sums, barriers, the best weights) at MASTER_ADDR:MASTER_PORT, which the command
exports to every instance. The config is loaded and validated here first, so a bad key fails
before any IPU is reserved.

``--slurm-script`` writes a batch script for Slurm with V-IPU's host-IPU mapping (the
recommended integration: the job's hosts determine its IPUs and the site's prolog creates
the partition, exported as IPUOF_VIPU_API_PARTITION_ID): the hosts and MASTER_ADDR come from
the job's node list when it starts.
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

SDK_ENV = ("LD_LIBRARY_PATH", "PATH", "PYTHONPATH", "POPLAR_SDK_ENABLED")


def poprun_command(
    args: argparse.Namespace, hosts: list[str], master: str | None = None
) -> list[str]:
    """The poprun argv for the parsed arguments (config included).

    ``master`` is the host of the instances' process group; None exports MASTER_ADDR and
    MASTER_PORT from the launching shell's environment instead (the Slurm script sets them).
    """
    # per instance: at most 64 replicas, a power of two (config.check_ipu_replicas)
    cfg = load_config(args.config, args.overrides, instances=args.instances)
    replicas, instances = cfg.backend.replicas, args.instances
    if cfg.backend.device != "ipu":
        raise ConfigError(
            f"poprun runs on IPU-PODs: set backend.device=ipu, not {cfg.backend.device}"
        )
    if args.ipus_per_replica != 1:
        raise ConfigError(
            f"--ipus-per-replica={args.ipus_per_replica}: the model runs one replica per IPU "
            "(it is neither pipelined nor sharded), so a replica cannot use more IPUs; "
            "raise backend.replicas instead"
        )
    if replicas % instances:
        raise ConfigError(
            f"backend.replicas={replicas} must be a multiple of --instances={instances} "
            "(each instance drives the same number of replicas)"
        )
    if hosts and instances % len(hosts):
        raise ConfigError(f"--instances={instances} must spread evenly over {len(hosts)} hosts")
    command = [
        "poprun",
        "-vv",
        f"--num-instances={instances}",
        f"--num-replicas={replicas}",
        "--ipus-per-replica=1",
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
    exports = []
    if instances > 1:  # the instances' gloo group meets at MASTER_ADDR:MASTER_PORT
        if master is None:
            exports += ["-x MASTER_ADDR", "-x MASTER_PORT"]
        else:
            exports += [f"-x MASTER_ADDR={master}", f"-x MASTER_PORT={args.master_port}"]
    if len(hosts) > 1 or master is None:  # forward the SDK environment to every host
        exports += [f"-x {name}" for name in SDK_ENV]
    if exports:
        command.append(f"--mpi-local-args={' '.join(exports)}")
    program = [sys.executable if args.python is None else args.python, str(REPO / "train.py")]
    if args.config is not None:
        program += ["--config", str(args.config)]
    return command + program + list(args.overrides)


HOSTS_VAR, HOSTS_SLOT = "${HOSTS}", "@HOSTS@"


def slurm_script(args: argparse.Namespace) -> str:
    """A Slurm batch script running the poprun command on the job's ``--nodes`` hosts."""
    hosts = [HOSTS_SLOT] if args.nodes > 1 else []
    command = shlex.join(poprun_command(args, hosts, master=None))
    command = command.replace(HOSTS_SLOT, HOSTS_VAR)
    if args.instances % args.nodes:
        raise ConfigError(f"--instances={args.instances} must spread evenly over --nodes")
    return "\n".join(
        [
            "#!/bin/bash",
            "#SBATCH --job-name=schnet-ipu",
            f"#SBATCH --nodes={args.nodes}",
            "#SBATCH --ntasks-per-node=1",
            "#SBATCH --exclusive",
            f"#SBATCH --time={args.time}",
            "#SBATCH --output=schnet-ipu-%j.out",
            "# Written by scripts/poprun.py. V-IPU host-IPU mapping: the prolog creates the",
            "# job's partition and exports IPUOF_VIPU_API_PARTITION_ID, which poprun reads.",
            "set -euo pipefail",
            f"cd {shlex.quote(str(REPO))}",
            'HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
            'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f"export MASTER_PORT={args.master_port}",
            command,
            "",
        ]
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="YAML config for train.py")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for train.py")
    parser.add_argument("--instances", type=int, default=1, help="host processes (poprun)")
    parser.add_argument("--ipus-per-replica", type=int, default=1, help="must be 1")
    parser.add_argument("--hosts", default="", help="comma-separated host names")
    parser.add_argument("--partition", default="", help="V-IPU partition name")
    parser.add_argument("--vipu-server-host", default="", help="V-IPU controller host")
    parser.add_argument("--executable-cache", default="", help="shared Poplar executable cache")
    parser.add_argument("--output-from", type=int, default=0, help="instance whose output shows")
    parser.add_argument("--python", help="interpreter on the hosts (default: this one)")
    parser.add_argument("--master-port", type=int, default=29500, help="instances' gloo port")
    parser.add_argument("--slurm-script", type=Path, help="also write a Slurm batch script")
    parser.add_argument("--nodes", type=int, default=1, help="Slurm: hosts of the job")
    parser.add_argument("--time", default="24:00:00", help="Slurm: time limit")
    parser.add_argument("--exec", action="store_true", help="run the command, not just print it")
    args = parser.parse_args(argv)
    if args.instances < 1 or args.ipus_per_replica < 1 or args.nodes < 1:
        parser.error("--instances, --ipus-per-replica and --nodes must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    hosts = [h for h in args.hosts.split(",") if h]
    try:
        command = poprun_command(args, hosts, master=hosts[0] if hosts else "127.0.0.1")
        if args.slurm_script is not None:
            args.slurm_script.write_text(slurm_script(args))
            args.slurm_script.chmod(0o755)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(shlex.join(command))
    if args.slurm_script is not None:
        print(f"wrote {args.slurm_script}: submit it with sbatch", file=sys.stderr)
    if not args.exec:
        return 0
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
