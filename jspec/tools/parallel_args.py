"""The parallelism flags of ``jspec generate`` and ``jspec bench``: tensor/data parallel sizes (vLLM's names) and
multi-host start-up through ``jax.distributed``.

Multi-host: every process runs the same command with its own ``--process-id``; or with ``--distributed`` alone,
where ``jax.distributed.initialize`` finds what is missing in the environment (JAX_COORDINATOR_ADDRESS, SLURM,
Open MPI, TPU pods). All processes compute the same output; only process 0 prints it.
"""

from __future__ import annotations

import argparse
import os
import sys


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("parallelism (a (data, model) device mesh; see docs/scaling.md)")
    group.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                       help="devices the target's weights are split over (heads, MLP features, vocabulary)")
    group.add_argument("-dp", "--data-parallel-size", type=int, default=1,
                       help="groups of tensor-parallel devices that the batch rows are split across")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="a mixture-of-experts target's experts split whole over the -dp groups (each expert "
                            "sliced over -tp), instead of every device holding a slice of every expert")
    group.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                       help="multi-host: process 0's address, the same on every process (jax.distributed)")
    group.add_argument("--num-processes", type=int, default=None, help="multi-host: how many processes in all")
    group.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index, 0-based")
    group.add_argument("--distributed", action="store_true",
                       help="multi-host: start jax.distributed with what the three flags above leave unset taken "
                            "from the environment (JAX_COORDINATOR_ADDRESS, SLURM, Open MPI, TPU pods)")


def check_parallel_args(args: argparse.Namespace) -> None:
    """Refuses bad values by flag name, before anything starts."""
    for flag, value in (("--tensor-parallel-size", args.tensor_parallel_size),
                        ("--data-parallel-size", args.data_parallel_size)):
        if value < 1:
            raise ValueError(f"{flag} {value}: expected an integer >= 1")
    given = [args.coordinator_address is not None, args.num_processes is not None, args.process_id is not None]
    if any(given) and not all(given) and not args.distributed:
        raise ValueError("multi-host needs all three of --coordinator-address, --num-processes and --process-id "
                         "(or --distributed, to take the missing ones from the environment)")
    if all(given) and not 0 <= args.process_id < args.num_processes:
        raise ValueError(f"--process-id {args.process_id}: expected 0 .. {args.num_processes - 1} "
                         f"(--num-processes {args.num_processes})")


def start_processes(args: argparse.Namespace) -> None:
    """``jax.distributed.initialize`` when the multi-host flags are given (before JAX touches any device; CPU
    collectives through gloo), and from then on only process 0 writes to stdout."""
    import jax

    check_parallel_args(args)
    if args.coordinator_address is not None or args.distributed:
        _initialize(args)
    need, available = args.tensor_parallel_size * args.data_parallel_size, len(jax.devices())
    if need > available:
        hint = (" (on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N gives N virtual devices)"
                if jax.default_backend() == "cpu" else "")
        raise ValueError(f"-tp {args.tensor_parallel_size} x -dp {args.data_parallel_size} needs {need} devices, "
                         f"but only {available} are available{hint}")


def _initialize(args: argparse.Namespace) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator_address, num_processes=args.num_processes,
                               process_id=args.process_id)
    if jax.process_index() != 0:  # the file descriptor too: gloo's C++ logging writes to it directly
        sys.stdout.flush()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def mesh_kwargs(args: argparse.Namespace) -> dict:
    """The flags as ``SpecEngine.from_pretrained`` keyword arguments."""
    kwargs = {"tensor_parallel_size": args.tensor_parallel_size, "data_parallel_size": args.data_parallel_size}
    if args.enable_expert_parallel:
        kwargs["enable_expert_parallel"] = True
    return kwargs
