"""
Tests of router.py (the replicas' request router) and of the parts of the GPU simulator that issues
41, 44 and 45 add: the host's overhead, tensor parallelism's all-reduces, data parallel routing and
disaggregated prefill/decode (cost_model.py, simulate.py, simulate_cluster.py). Every oracle is
independent: brute-force prefix matching, hand-computed ring all-reduce and transfer arithmetic, the
measured numbers of the H100 run, counts of what the threads did. Fast: seconds on 2 cores.
"""
import json
import math
import random
import threading

import numpy as np
import pytest

import cost_model as cm
import simulate as sim
import simulate_cluster as sc
from errors import InvalidRequest
from router import PrefixTree, Router, RouterConfig


# ##################################################################################################
# router.py
# ##################################################################################################

def tenant_prompt(tenant, question, system_len=64):
    return [1000 + tenant] * system_len + [10_000 + question] * 8     # a system prompt, then the question


def test_prefix_tree_matches_a_brute_force_longest_common_prefix():
    rng = random.Random(0)
    tree, inserted = PrefixTree(), []
    lcp = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    for _ in range(300):
        base = rng.choice(inserted) if inserted and rng.random() < 0.7 else []
        seq = base[:rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(0, 12))]
        query = base[:rng.randint(0, len(base))] + [rng.randrange(4) for _ in range(rng.randint(0, 6))]
        assert tree.match(query) == max((lcp(query, s) for s in inserted), default=0)
        tree.insert(seq)
        inserted.append(seq)
    # distinct tokens on the edges == tokens of the trie of all inserted sequences (prefixes counted once)
    assert tree.num_tokens == len({tuple(s[:i + 1]) for s in inserted for i in range(len(s))})


def test_round_robin_alternates_and_least_loaded_picks_the_least_loaded():
    rr = Router(RouterConfig("round_robin"), ["a", "b", "c"])
    assert [rr.route([1, 2]) for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    ll = Router(RouterConfig("least_loaded"), ["a", "b", "c"])
    ll.update_load("a", 5)
    ll.update_load("b", 2)
    ll.update_load("c", 7)
    # b climbs 2 -> 5 (three routes); at 5-5 the tie goes to the earliest to join, a; then b, a, b ...
    assert [ll.route([1]) for _ in range(6)] == ["b", "b", "b", "a", "b", "a"]
    ll.finish("c")
    assert ll.loads() == {"a": 7, "b": 6, "c": 6}
    assert ll.decision_counts() == {("least_loaded", "least_loaded", "b"): 4, ("least_loaded", "least_loaded", "a"): 2}


def test_cache_aware_keeps_every_tenant_on_one_worker_while_loads_stay_balanced():
    router = Router(RouterConfig("cache_aware"), [0, 1])
    rng = random.Random(1)
    homes, per_worker, in_flight = {}, [0, 0], []
    for q in range(800):
        tenant = rng.randrange(8)
        w = router.route(tenant_prompt(tenant, q))
        homes.setdefault(tenant, set()).add(w)
        per_worker[w] += 1
        in_flight.append(w)
        if len(in_flight) > 16:                          # requests finish 16 routes later: loads stay bounded
            router.finish(in_flight.pop(0))
    assert all(len(ws) == 1 for ws in homes.values()), homes          # tenant affinity
    assert sorted(sum(1 for ws in homes.values() if w in ws) for w in (0, 1)) == [4, 4]
    assert abs(per_worker[0] - per_worker[1]) <= 0.15 * 800, per_worker  # 8 equally likely tenants split 4:4
    reasons = {r for (_, r, _) in router.decision_counts()}
    assert reasons == {"least_loaded", "prefix_match"}                # the guard never had to fire
    counts = router.decision_counts()
    assert sum(n for (_, r, _), n in counts.items() if r == "least_loaded") == 8   # one first request per tenant


def test_balance_guard_overrides_the_prefix_match_past_its_threshold():
    router = Router(RouterConfig("cache_aware", balance_rel=1.5, balance_abs=4), ["hot", "cold"])
    assert router.route(tenant_prompt(0, 0)) == "hot"                 # cold start: least loaded, ties -> first
    router.update_load("hot", 7)
    router.update_load("cold", 2)                                     # 7 > 1.5 * 2 + 4 = 7 is false: match wins
    assert router.route(tenant_prompt(0, 1)) == "hot"
    router.update_load("hot", 8)                                      # 8 > 7: the guard sends it to the cold one
    assert router.route(tenant_prompt(0, 2)) == "cold"
    assert router.decision_counts()[("cache_aware", "balance_guard", "cold")] == 1


def test_reported_evictions_and_the_size_bound_make_the_router_forget():
    router = Router(RouterConfig("cache_aware"), [0, 1])
    assert router.route(tenant_prompt(3, 0)) == 0
    router.update_load(0, 3)
    assert router.route(tenant_prompt(3, 1)) == 0                     # affinity despite the higher load
    router.evicted(0, tenant_prompt(3, 0)[:32])                       # worker 0 dropped the prompt's 2nd half block
    assert router.trees[0].match(tenant_prompt(3, 9)) == 31           # the tree keeps 31 tokens, not 32
    assert router.route(tenant_prompt(3, 2)) == 1                     # 31 / 72 < 0.5: least loaded wins
    # size bound: LRU leaves go first, down to 90% of the bound
    tree = PrefixTree()
    tree.insert([1] * 60)
    tree.insert([2] * 30)
    tree.insert([1] * 60)                                             # [1]*60 is now the most recent
    tree.insert([3] * 30)                                             # 120 tokens
    tree.shrink(100)                                                  # drop [2]*30 (oldest): 90 <= 90
    assert (tree.match([1] * 60), tree.match([2] * 30), tree.match([3] * 30), tree.num_tokens) == (60, 0, 30, 90)
    bounded = Router(RouterConfig("cache_aware", max_tree_tokens=200), ["w"])
    for q in range(50):
        bounded.route(tenant_prompt(q, q))
    assert bounded.tree_tokens()["w"] <= 200


def test_a_worker_leaving_drops_its_tree_and_its_tenants_reroute():
    router = Router(RouterConfig("cache_aware"), ["a", "b"])
    router.update_load("a", 1)
    assert router.route(tenant_prompt(5, 0)) == "b"
    router.update_load("a", 0)
    router.remove_worker("b")
    assert router.route(tenant_prompt(5, 1)) == "a"                   # rerouted ...
    router.add_worker("c")
    router.update_load("a", 3)
    assert router.route(tenant_prompt(5, 2)) == "a"                   # ... and sticks to its new home
    assert router.route(tenant_prompt(6, 0)) == "c"                   # a new tenant goes to the idle newcomer
    router.finish("b")                                                # a late report from the leaver: ignored
    with pytest.raises(InvalidRequest) as e:
        router.finish("nobody")
    assert e.value.field == "worker"
    rr = Router(RouterConfig("round_robin"), ["a", "b", "c"])
    assert rr.route([0]) == "a"
    rr.remove_worker("a")
    assert [rr.route([0]) for _ in range(3)] == ["b", "c", "b"]
    with pytest.raises(InvalidRequest) as e:
        Router(RouterConfig(policy="random"))
    assert e.value.field == "policy"


def test_concurrent_routing_from_threads_keeps_the_counts_consistent():
    router = Router(RouterConfig("cache_aware", balance_abs=2), list(range(4)))
    routed = [[] for _ in range(8)]

    def client(k):
        for q in range(300):
            routed[k].append(router.route(tenant_prompt((k + q) % 16, q)))
            if q % 2:
                router.finish(routed[k][-2])
    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent = [w for ws in routed for w in ws]
    finished = [w for ws in routed for i, w in enumerate(ws) if i % 2 == 0]
    assert sum(router.decision_counts().values()) == len(sent) == 2400
    per_worker = {w: sent.count(w) for w in range(4)}
    assert {w: sum(n for (_, _, x), n in router.decision_counts().items() if x == w) for w in range(4)} == per_worker
    assert router.loads() == {w: per_worker[w] - finished.count(w) for w in range(4)}


# ##################################################################################################
# cost_model.py: host overhead and tensor parallelism
# ##################################################################################################

H100, A100 = cm.GPUS["h100-sxm"], cm.GPUS["a100-80gb"]
LLAMA3_8B, LLAMA3_70B = cm.MODELS["llama-3-8b"], cm.MODELS["llama-3-70b"]
SMOLLM2 = cm.ModelConfig("SmolLM2-135M", 30, 576, 9, 3, 64, 1536, 49152)   # the model of the H100 run
NVLINK4 = cm.LINKS["nvlink4"]
NO_HOST = cm.HostOverhead()


def test_all_reduce_cost_is_ring_arithmetic():
    # 4 GPUs, 64 tokens of hidden 4096 in bf16: 524,288 bytes; 2 * 3 / 4 of them over 370 GB/s, 6 hops of 2 us
    assert cm.all_reduce_time(524_288, 4, NVLINK4) == pytest.approx(1.5 * 524_288 / 370e9 + 6 * 2e-6, rel=1e-12)
    assert cm.all_reduce_time(524_288, 1, NVLINK4) == 0.0
    per_layer = 2 * (2 * 7 / 8 * 8192 * 2 / 25e9 + 14 * 5e-6)          # 70B, one token, tp 8, PCIe Gen4
    assert cm.tp_comm_time(LLAMA3_70B, 1, 8, cm.LINKS["pcie4"]) == pytest.approx(80 * per_layer, rel=1e-12)
    # a whole tp = 4 decode step, memory-bound: weights / 4 and KV / 4 per GPU, then 64 all-reduces
    rows = [(1, 1000)] * 64
    weights, kv = 2 * 8_030_261_248, 64 * 1001 * 131_072
    expected = (weights / 4 + kv / 4) / (3.35e12 * cm.MEM_EFFICIENCY) + 64 * (1.5 * 524_288 / 370e9 + 6 * 2e-6)
    assert cm.step_time(H100, LLAMA3_8B, rows, 4, host=NO_HOST) == pytest.approx(expected, rel=1e-12)
    assert cm.step_time(H100, LLAMA3_8B, rows, 4) == pytest.approx(expected + cm.STEP_OVERHEAD_S, rel=1e-12)


def test_tensor_parallel_size_1_is_the_single_gpu_step_on_any_link():
    for rows in ([(1, 500)], [(1, 30)] * 100, [(2048, 0)], [(300, 100), (1, 7)]):
        single = cm.step_time(H100, LLAMA3_8B, rows)
        for link in cm.LINKS.values():
            assert cm.step_time(H100, LLAMA3_8B, rows, 1, link=link) == single
    base = sim.simulate(sim.parse_run(["--num-requests", "50"]))
    tp1 = sim.simulate(sim.parse_run(["--num-requests", "50", "--tensor-parallel-size", "1", "--tp-link", "pcie"]))
    assert tp1["wall_s"] == base["wall_s"] and tp1["num_steps"] == base["num_steps"]
    # more GPUs: faster decode on NVLink, and the all-reduces are what PCIe loses
    assert cm.step_time(H100, LLAMA3_8B, rows, 2, link=NVLINK4) < cm.step_time(H100, LLAMA3_8B, rows, 2, link=cm.LINKS["pcie5"])


def test_kv_heads_decide_which_tensor_parallel_sizes_run():
    cm.check_tensor_parallel(LLAMA3_8B, 8)
    with pytest.raises(ValueError, match=r"sizes that do: \[1, 3, 9\]"):
        cm.check_tensor_parallel(SMOLLM2, 2)
    cm.check_tensor_parallel(SMOLLM2, 9)                           # 3 KV heads replicated 3 times
    assert cm.kv_shards(SMOLLM2, 9) == 3
    assert cm.kv_pool_tokens(H100, SMOLLM2, 0.9, 9) == int((9 * 80e9 * 0.9 - SMOLLM2.weight_bytes) * 3 / 9
                                                           // SMOLLM2.kv_bytes_per_token)
    assert cm.resolve_link("nvlink", A100) is cm.LINKS["nvlink3"] and cm.resolve_link("pcie", H100) is cm.LINKS["pcie5"]


def test_cuda_graphs_make_the_host_term_per_step():
    host = cm.HostOverhead(per_step_s=1e-3, per_seq_s=1e-5, per_launch_s=1e-4, launches_per_layer=10, graph_replay_s=3e-5)
    launches = 32 * 10 * 1e-4                                      # 32 ms: longer than any of these steps' GPU time
    for batch in (1, 8, 64):
        decode = [(1, 100)] * batch
        gpu = cm.step_time(H100, LLAMA3_8B, decode, host=NO_HOST)
        serial = 1e-3 + 1e-5 * batch
        assert cm.step_time(H100, LLAMA3_8B, decode, host=host) == pytest.approx(serial + launches, rel=1e-12)
        assert cm.step_time(H100, LLAMA3_8B, decode, host=host, graphs=True) == pytest.approx(serial + gpu, rel=1e-12)
    prefill = [(512, 0), (1, 100)]                                 # not decode-only: eager even with graphs on
    assert cm.step_time(H100, LLAMA3_8B, prefill, host=host, graphs=True) == pytest.approx(1e-3 + 2e-5 + launches)
    # tensor parallelism launches two all-reduces per layer more
    assert host.time(LLAMA3_8B, 1, 2, graph=False)[1] == pytest.approx(32 * 12 * 1e-4)


def test_fitted_host_overhead_reproduces_the_h100_run():
    run = cm.H100_RUN_2026_11_24["roofline"]["decode"]
    batches = sorted(int(b) for b in run)
    serial = [sum(run[str(b)]["phases_s"][p] for p in ("schedule", "prepare", "sample", "update")) for b in batches]
    slope, intercept = np.polyfit(batches, serial, 1)              # the oracle: numpy's least squares
    fit = cm.HOST_OVERHEADS["nanoserve-h100"]
    assert (fit.per_seq_s, fit.per_step_s) == (pytest.approx(slope, rel=1e-9), pytest.approx(intercept, rel=1e-9))
    assert fit.per_launch_s == pytest.approx(np.median([run[str(b)]["phases_s"]["forward"] for b in batches]) / 1430)
    for b in batches:                                              # README: 23.4, 25.4, 25.5, 25.9 ms, eager
        t = cm.step_time(H100, SMOLLM2, [(1, 32)] * b, host=fit)
        assert t == pytest.approx(run[str(b)]["step_s_median"], rel=0.1)
        assert cm.step_time(H100, SMOLLM2, [(1, 32)] * b, host=fit, graphs=True) < 0.005   # issue 41's target
    with pytest.raises(ValueError, match="not host-bound"):
        cm.fit_host_overhead({"roofline": {"decode": {"8": {"matmul_floor_s": 0.02, "phases_s": {
            "schedule": 0, "prepare": 0, "forward": 0.025, "sample": 0, "update": 0}}}}})


def test_tp_sweep_finds_where_the_batch1_step_stops_shrinking(capsys):
    rows = [{"tp": 1, "fits": False}, {"tp": 2, "fits": True, "batch1_ms": 30, "tok_s_per_gpu": 10},
            {"tp": 4, "fits": True, "batch1_ms": 20, "tok_s_per_gpu": 30}, {"tp": 8, "fits": True, "batch1_ms": 18,
                                                                            "tok_s_per_gpu": 20}]
    assert cm.where_tp_stops(rows, 1.2) == {"latency_n": 4, "throughput_n": 4}    # 30/20 = 1.5, 20/18 = 1.11
    cm.tp_sweep_main(["--models", "llama-3-70b", "--gpus", "h100-sxm", "--links", "nvlink"])
    out = capsys.readouterr().out
    assert "| 1 | does not fit" in out and "| 8 |" in out and "latency pays up to tp=" in out


# ##################################################################################################
# simulate_cluster.py: data parallel and disaggregation
# ##################################################################################################

def cluster_args(*argv):
    return sim.parse_run(["--gpu", "a100-80gb", "--model", "llama-2-13b", "--num-requests", "60",
                          "--request-rate", "4", *argv])


def test_kv_transfer_time_is_bytes_over_bandwidth_and_one_request_adds_up_by_hand():
    args = cluster_args("--disaggregation", "1:1", "--kv-link", "infiniband", "--workload", "uniform",
                        "--input-len", "1000", "--output-len", "5", "--num-requests", "1")
    res = sc.simulate_cluster(args)
    model, link = cm.MODELS["llama-2-13b"], cm.LINKS["ib-hdr"]
    nbytes = 1000 * 2 * 40 * 40 * 128 * 2                          # tokens x K,V x layers x heads x head dim x bf16
    transfer = nbytes / 21e9 + 5e-6
    assert res["kv_transfer"]["gb"] == pytest.approx(nbytes / 1e9) and res["kv_transfer"]["mean_ms"] == pytest.approx(1e3 * transfer)
    prefill = cm.step_time(A100, model, [(1000, 0)])
    decode = sum(cm.step_time(A100, model, [(1, 1000 + j)]) for j in range(4))   # tokens 2..5
    (ttft, tpot), = res["latencies"]
    assert ttft == pytest.approx(prefill, rel=1e-9)
    assert tpot == pytest.approx((transfer + decode) / 4, rel=1e-9)
    many = sc.simulate_cluster(cluster_args("--disaggregation", "2:1", "--workload", "sharegpt"))
    reqs = sim.make_requests(cluster_args("--workload", "sharegpt"))
    moved = [r for r in reqs if r.output_len > 1]
    assert many["kv_transfer"]["count"] == len(moved)
    assert many["kv_transfer"]["gb"] == pytest.approx(sum(r.input_len for r in moved) * model.kv_bytes_per_token / 1e9)


def test_disaggregated_prefill_engines_never_run_decode_steps(monkeypatch):
    seen = []                                                      # (engine role, rows) of every scheduled step
    real_engine = sc.Cluster.engine

    def spying_engine(self, name, role):
        e = real_engine(self, name, role)
        schedule = e.sched.schedule

        def spy():
            batch = schedule()
            seen.append((role, [(s.num_computed_tokens, n, s.num_prompt_tokens) for s, n in zip(batch.seqs, batch.num_tokens)]))
            return batch
        e.sched.schedule = spy
        return e
    monkeypatch.setattr(sc.Cluster, "engine", spying_engine)
    res = sc.simulate_cluster(cluster_args("--disaggregation", "2:2", "--workload", "sharegpt", "--num-requests", "120",
                                           "--request-rate", "8", "--max-num-batched-tokens", "256"))
    prefill_rows = [row for role, rows in seen if role == "prefill" for row in rows]
    decode_rows = [row for role, rows in seen if role == "decode" for row in rows]
    assert prefill_rows and all(c + n <= p for c, n, p in prefill_rows)      # only prompt tokens, chunked or not
    assert any(c + n < p for c, n, p in prefill_rows)                        # (some prompts were chunked)
    assert decode_rows and all(c >= p for c, n, p in decode_rows)            # decodes never prefill a prompt
    assert {e["role"]: e["decode_rows"] for e in res["engines"].values() if e["role"] == "prefill"} == {"prefill": 0}
    assert all(math.isfinite(a) for a, _ in res["latencies"])


def test_data_parallel_cache_aware_routing_raises_the_prefix_hit_rate():
    flags = ["--gpu", "h100-sxm", "--model", "llama-3-8b", "--workload", "tenants", "--num-tenants", "24",
             "--system-prompt-len", "2000", "--input-len", "50", "--output-len", "20", "--enable-prefix-caching",
             "--data-parallel-size", "2", "--gpu-memory-utilization", "0.26", "--num-requests", "400",
             "--request-rate", "50"]
    runs = {policy: sim.run(sim.parse_run(flags + ["--routing", policy])) for policy in ("round_robin", "cache_aware")}
    rr, ca = runs["round_robin"], runs["cache_aware"]
    # 24 prompts of 2,000 tokens: all fit one pool (36k tokens) split 12:12, not all 24 on each engine
    assert ca["prefix_hit_rate"] > 1.3 * rr["prefix_hit_rate"], (ca["prefix_hit_rate"], rr["prefix_hit_rate"])
    assert ca["ttft_s"]["p90"] < rr["ttft_s"]["p90"]
    per_engine = [sum(n for k, n in ca["routing"].items() if k.endswith(w)) for w in ("engine0", "engine1")]
    assert sum(per_engine) == 400 and min(per_engine) >= 0.3 * 400


def test_goodput_is_the_interpolated_rate_where_attainment_crosses_the_target():
    assert sc.goodput([1, 2, 3], [1.0, 0.95, 0.5], 0.9) == pytest.approx(2 + (0.95 - 0.9) / (0.95 - 0.5))
    assert sc.goodput([1, 2, 3], [0.8, 0.5, 0.1], 0.9) == 0.0
    assert sc.goodput([1, 2, 3], [1.0, 1.0, 0.95], 0.9) == 3
    lat = [(0.1, 0.02), (0.3, 0.02), (0.1, 0.05), (0.1, math.nan)]  # misses TTFT, misses TPOT, single token
    assert sc.attainment(lat, 0.2, 0.03) == 0.5


def test_disagg_sweep_writes_the_table_plot_and_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sc, "SWEEP_WORKLOADS", {"long-prompt": (1.0, 0.035, (0.5, 4)), "short-prompt": (0.25, 0.035, (2, 40))})
    monkeypatch.setattr(sc, "SWEEP_SYSTEMS", {k: sc.SWEEP_SYSTEMS[k] for k in ("colocated, budget 8192", "disaggregated 1:1")})
    sc.disagg_sweep_main(["--out", str(tmp_path), "--num-requests", "20", "--min-seconds", "0"])
    text = (tmp_path / "disaggregation.md").read_text()
    assert "| disaggregated 1:1 | 2 |" in text and "| colocated, budget 8192 | 2 |" in text
    assert (tmp_path / "disaggregation.png").stat().st_size > 0
    saved = json.loads((tmp_path / "disaggregation.json").read_text())
    assert saved["slo"]["long-prompt"] == {"ttft_s": 1.0, "tpot_s": 0.035, "rates_per_gpu": [0.5, 4]}
    assert len(saved["goodput_per_gpu"]) == 2 * 2 * len(sc.SLO_SCALES)
    capsys.readouterr()


def test_bad_cluster_arguments_are_rejected_naming_the_flag(capsys):
    for argv, message in [(["--disaggregation", "0:1"], "--disaggregation must be P:D"),
                          (["--disaggregation", "1:1", "--data-parallel-size", "2"], "--data-parallel-size must be 1"),
                          (["--data-parallel-size", "2", "--scheduler-mode", "static"], "--scheduler-mode must be continuous"),
                          (["--host-overhead", "fast"], "--host-overhead must be one of")]:
        with pytest.raises(SystemExit):
            sim.parse_run(argv)
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="sizes that do"):
        sim.simulate(sim.parse_run(["--tensor-parallel-size", "3", "--num-requests", "1"]))
