"""
The simulators' command line, `python -m sim ...`: one engine (simulate.py) or several behind a router
or split prefill/decode (simulate_cluster.py), chosen from the flags; plus the roofline of one step and
the tensor-parallel and disaggregation sweeps. Owns only the dispatch, the rate sweep and the output;
the simulation itself lives in the modules it calls.

  python -m sim --gpu h100-sxm --model llama-3-8b --workload sharegpt --num-requests 1000
  python -m sim --workload tenants --enable-prefix-caching --data-parallel-size 2 --routing cache_aware
  python -m sim --workload long-prompt --disaggregation 1:1 --kv-link infiniband --request-rate 4
  python -m sim roofline --gpu a100-80gb --model llama-2-13b --batch 32
  python -m sim tp-sweep                       # where tensor parallelism stops paying (cost_model.py)
  python -m sim disagg-sweep --out docs/       # disaggregated vs colocated goodput per GPU
  python -m sim tiers --model llama-3-8b       # restoring a prefix from host memory or disk vs recompute
"""
import argparse
import json
import sys

from sim import simulate_cluster
from sim.cost_model import (GPUS, MODELS, check_tensor_parallel, host_overhead, resolve_link, roofline, tiers_main,
                            tp_sweep_main)
from sim import simulate as sim_one
from sim.simulate import parse_roofline, parse_run, plot, simulate


def run(args) -> dict:
    """One engine, or several (simulate_cluster.py) when the flags ask for them."""
    if args.data_parallel_size > 1 or args.disaggregation:
        return simulate_cluster.simulate_cluster(args)
    return simulate(args)


def sweep(args) -> dict:
    """Every variant (mode or mode/policy) at every rate: {variant: [result, ...]}."""
    results = {}
    for variant in args.sweep_variants.split(","):
        mode, _, policy = variant.partition("/")
        results[variant] = [run(argparse.Namespace(**{**vars(args), "request_rate": rate, "scheduler_mode": mode,
                                                          "scheduling_policy": policy or args.scheduling_policy}))
                            for rate in args.sweep_rates]
    return results


def print_table(res: dict):
    """Several engines get simulate_cluster.py's table, one engine simulate.py's."""
    table = simulate_cluster.print_table if "engines" in res else sim_one.print_table
    table(res)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["roofline"]:
        a = parse_roofline(argv[1:])
        gpu, model = GPUS[a.gpu], MODELS[a.model]
        try:
            check_tensor_parallel(model, a.tensor_parallel_size)
        except ValueError as e:
            sys.exit(f"python -m sim: error: {e}")
        print(json.dumps(roofline(gpu, model, a.batch, a.context, a.tensor_parallel_size,
                                  host=host_overhead(a.host_overhead), graphs=not a.enforce_eager,
                                  link=resolve_link(a.tp_link, gpu)), indent=2))
        return
    if argv[:1] == ["tp-sweep"]:
        return tp_sweep_main(argv[1:])
    if argv[:1] == ["tiers"]:
        return tiers_main(argv[1:])
    if argv[:1] == ["disagg-sweep"]:
        return simulate_cluster.disagg_sweep_main(argv[1:])
    args = parse_run(argv)
    try:
        results = sweep(args) if args.sweep_rates else {args.scheduler_mode: [run(args)]}
    except ValueError as e:                              # a configuration that cannot run: say why, no traceback
        sys.exit(f"python -m sim: error: {e}")
    for runs in results.values():
        for res in runs:
            print_table(res)
            print()
    if args.out:
        slim = {name: [{k: v for k, v in r.items() if k != "timeline"} for r in runs] for name, runs in results.items()}
        with open(args.out, "w") as f:
            json.dump(slim if args.sweep_rates else slim[args.scheduler_mode][0], f, indent=2)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
