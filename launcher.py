"""
The one place serve.py gets its engine cores from: launch_client picks, from the flags, the client
its front end talks to. One engine core in a process of its own (the default: engine_client.py),
data-parallel cores behind a router, or prefill and decode cores with the KV moved between them (both
from the scale-out package, imported only when the flags ask for them). The processes that serve no
HTTP start here too: torchrun's ranks other than 0 (run_tensor_parallel_worker) and --headless cores.
Owns the choice and the checks of which flags combine; no HTTP, no engine loop, no routing.
"""
import argparse
import os
import sys

from engine import EngineConfig
from engine_client import EngineClient
from scaleout.router import POLICIES as ROUTING_POLICIES   # noqa: F401  serve.py's --routing choices


def launch_client(config: EngineConfig, args: argparse.Namespace):
    """-> a started-later client (EngineClient, or scale-out's DataParallelClient / DisaggregatedClient).
    Raises ValueError naming the flag when flags do not combine."""
    address = (args.data_parallel_address, args.data_parallel_rpc_port)
    if args.disaggregation_mode is not None:
        raise ValueError("--disaggregation-mode is for --headless cores; the front end takes --disaggregation")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 and config.tensor_parallel_size > 1:
        raise ValueError("--data-parallel-size > 1 with --tensor-parallel-size > 1 is not supported yet")
    if args.disaggregation is not None:
        if args.data_parallel_size > 1 or config.tensor_parallel_size > 1 or args.speculative_config:
            raise ValueError("--disaggregation does not combine with --data-parallel-size, "
                             "--tensor-parallel-size or --speculative-config yet")
        from scaleout.disaggregation import DisaggregatedClient
        return DisaggregatedClient.from_flags(config, args.disaggregation, args.disaggregation_local, address,
                                              args.grammar_compile_timeout)
    if args.data_parallel_size > 1:
        from scaleout.data_parallel import DataParallelClient, dp_key
        local = args.data_parallel_size if args.data_parallel_size_local is None else args.data_parallel_size_local
        if not 0 <= local <= args.data_parallel_size:
            raise ValueError(f"--data-parallel-size-local must be in [0, --data-parallel-size], got {local}")
        return DataParallelClient.in_processes(config, args.data_parallel_size, args.routing,
                                               args.grammar_compile_timeout, local, address,
                                               dp_key() if local < args.data_parallel_size else b"")
    return EngineClient.in_process(config, args.grammar_compile_timeout)   # builds the engine there


def run_tensor_parallel_worker(device: str = "auto") -> bool:
    """torchrun's ranks other than 0 serve no HTTP: each runs scale-out's worker loop on serve.py's --device
    (rank 0's). -> whether this was one."""
    if int(os.environ.get("RANK", "0")) == 0:
        return False
    from scaleout import parallel
    if not parallel.launched_by_torchrun():
        return False
    parallel.run_worker(device)
    return True


def run_headless(config: EngineConfig, args: argparse.Namespace) -> None:
    """serve.py --headless: only engine cores, for a front end on another machine; no HTTP."""
    from scaleout.data_parallel import dp_key, run_headless as run_cores
    try:
        key = dp_key()
    except ValueError as exc:
        sys.exit(f"serve.py: error: {exc}")
    run_cores(config, args.data_parallel_size_local or 1, (args.data_parallel_address, args.data_parallel_rpc_port),
              key, args.grammar_compile_timeout, args.disaggregation_mode or "both")
