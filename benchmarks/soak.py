"""
A bounded soak of serve.py: hundreds of concurrent clients on 127.0.0.1, then a check that nothing was lost.

Clients mix streamed and non-streamed completions and chats, n > 1, stop strings, seeds, clients that
hang up at a random point, malformed or oversized requests, and hostile ones (too many prompts x n, a
full logit_bias, thousands of stop strings, a huge grammar), against a KV pool small enough that the
engine must preempt. At the end every well-formed request must have finished (or been left by its own
client), every bad one must have had a 4xx naming the field, no answer may have lost or altered a token
(every finished greedy or seeded answer must carry exactly the text the offline engine, LLM.generate,
gives the same request with the same seed), the KV pool must be all free again, and /metrics must add
up: received = finished + aborted + rejected + failed.
It reports the p99 gap between a stream's tokens as well.
Owns only the load and the checks: it starts serve.py itself unless given --url, and changes nothing in it.
`python soak.py --minutes 1` (or `python bench.py soak --minutes 1 [--out results/]`, which calls main(argv)).
"""
import argparse
import asyncio
import collections
import io
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

from benchmarks import report

COUNTERS = ("received", "finished", "aborted", "rejected", "failed")
METRIC = {"received": "requests_received_total", "finished": "requests_finished_total",
          "aborted": "request_aborted_total", "rejected": "requests_rejected_total", "failed": "request_failures_total"}
CHAT = [{"role": "user", "content": "Name a fruit."}]
# (path, body, status, param or error code): each must be refused without costing the engine a step
BAD_INPUTS = [
    ("/v1/completions", "{not json", 400, "invalid_json"),
    ("/v1/completions", '{"prompt": ' + "[" * 5000 + "]" * 5000 + "}", 400, "invalid_json"),
    ("/v1/completions", json.dumps({"prompt": "x" * (2 << 20)}), 413, "body"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    # hostile: small bodies that ask for unbounded work
    ("/v1/completions", {"prompt": ["hi"] * 250, "n": 16}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(t): 1 for t in range(5000)}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "stop": [f"stop{i}" for i in range(20_000)]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": list(range(5000))}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"choice": [f"option {i}" for i in range(20_000)]}},
     400, "structured_outputs"),
    ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
]
# hostile but within the limits: each must wait its turn and be served
HEAVY = [
    {"prompt": "Tell me a story", "n": 16, "max_tokens": 8, "temperature": 1.0, "seed": 1,
     "logit_bias": {str(t): 0.5 for t in range(300)}},
    {"prompt": "Pick one:", "max_tokens": 8, "structured_outputs": {"choice": [f"option {i}" for i in range(1500)]}},
    {"prompt": ["Count:", "Say:", "List:", "Name:"], "n": 8, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
]
# greedy requests asked again and again, also checked against the offline engine
GREEDY_PROMPTS = [f"Fact {i}: the number {i} is" for i in range(8)]


def good_request(rng: random.Random) -> tuple[str, dict]:
    """A well-formed request: completion or chat, streamed or not, greedy or seeded, n, stops, salts."""
    body = {"max_tokens": rng.randint(1, 24), "stream": rng.random() < 0.6}
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body.update(temperature=1.0, seed=rng.randrange(1000))
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    if rng.random() < 0.5:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body["cache_salt"] = f"tenant-{rng.randrange(3)}"
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.7:
        return "/v1/completions", {**body, "prompt": f"Request {rng.randrange(10 ** 6)}: tell me about the number"}
    return "/v1/chat/completions", {**body, "messages": CHAT}


def choice_text(choice: dict, delta: bool = False) -> str:
    """A completion's text or a chat message's content (a streamed chunk's delta when delta)."""
    if "text" in choice:
        return choice["text"] or ""
    return (choice.get("delta" if delta else "message") or {}).get("content") or ""


async def streamed(http: httpx.AsyncClient, path: str, body: dict, hang_up_after: int | None,
                   gaps: list | None = None, answered: list | None = None) -> str:
    """'finished' when every choice got a finish_reason and [DONE] came; 'left' when we hung up.
    Appends the seconds between successive chunks that carry tokens, after the first (its wait is the
    TTFT, not a gap), of a finished stream to gaps, and (path, body, texts by choice) to answered."""
    finish, chunks, done, times, texts = {}, 0, False, [], collections.defaultdict(str)
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return f"status {r.status_code}: {r.text[:200]}"
        async for line in r.aiter_lines():
            if hang_up_after is not None and chunks >= hang_up_after:
                return "left"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error event: {event['error']}"
                for choice in event["choices"]:
                    texts[choice["index"]] += choice_text(choice, delta=True)
                    if choice.get("finish_reason"):
                        finish[choice["index"]] = choice["finish_reason"]
                chunks += 1
                if any(c.get("text") or c.get("delta", {}).get("content") for c in event["choices"]):
                    times.append(time.monotonic())
    if hang_up_after is not None:
        return "left"  # the stream ended before we hung up: counted as ours to leave anyway
    want = body.get("n", 1)
    ok = done and len(finish) == want and all(f in ("length", "stop") for f in finish.values())
    if ok and gaps is not None:
        gaps += [b - a for a, b in zip(times, times[1:])]
    if ok and answered is not None:
        answered.append((path, body, [texts[i] for i in range(want)]))
    return "finished" if ok else f"incomplete: done={done} finish={finish}"


async def greedy(http: httpx.AsyncClient, rng: random.Random, answered: list) -> str:
    """A greedy completion of a known prompt, asked again and again; its texts go to the oracle."""
    key = (rng.choice(GREEDY_PROMPTS), rng.choice([4, 12]))
    body = {"prompt": key[0], "max_tokens": key[1], "temperature": 0, "ignore_eos": True, "n": rng.choice([1, 2])}
    r = await http.post("/v1/completions", json=body)
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:200]}"
    texts = [c["text"] for c in r.json()["choices"]]
    answered.append(("/v1/completions", body, texts))
    return "finished" if len(texts) == body["n"] else f"incomplete: {texts}"


async def unary(http: httpx.AsyncClient, path: str, body: dict, hang_up_s: float | None,
                answered: list | None = None) -> str:
    try:
        r = await http.post(path, json=body, timeout=hang_up_s or http.timeout)
    except httpx.TimeoutException:
        if hang_up_s is not None:
            return "left"
        raise
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:200]}"
    choices = r.json()["choices"]
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
    ok = len(choices) == body.get("n", 1) * prompts and all(c["finish_reason"] in ("length", "stop") for c in choices)
    if ok and answered is not None:
        answered.append((path, body, [choice_text(c) for c in sorted(choices, key=lambda c: c["index"])]))
    return "finished" if ok else f"incomplete: {choices}"


async def bad(http: httpx.AsyncClient, case) -> str:
    path, body, status, param = case
    content = body if isinstance(body, str) else json.dumps(body)
    r = await http.post(path, content=content, headers={"Content-Type": "application/json"})
    error = r.json().get("error", {}) if r.headers.get("content-type", "").startswith("application/json") else {}
    named = param in (error.get("param"), error.get("code"))
    return "refused" if r.status_code == status and named else f"bad input {case[2:]} got {r.status_code} {error}"


async def client(http: httpx.AsyncClient, rng: random.Random, deadline: float, tally: dict, problems: list,
                 state: dict):
    while time.monotonic() < deadline:
        roll = rng.random()
        try:
            if roll < 0.12:
                case = rng.choice(BAD_INPUTS)
                outcome, kind = await bad(http, case), "bad_inputs"
                state["refused_by_field"][f"{case[2]} {case[3]}"] += outcome == "refused"
            elif roll < 0.14:
                outcome, kind = await unary(http, "/v1/completions", rng.choice(HEAVY), None, state["answered"]), "heavy"
            elif roll < 0.24:
                outcome, kind = await greedy(http, rng, state["answered"]), "requests"
            else:
                path, body = good_request(rng)
                leave = roll < 0.3                                   # ~18% of good requests hang up
                kind = "disconnects" if leave else "requests"
                if body["stream"]:
                    outcome = await streamed(http, path, body, rng.randint(0, 4) if leave else None, state["gaps"],
                                             state["answered"])
                else:
                    outcome = await unary(http, path, body, rng.uniform(0.05, 1.0) if leave else None,
                                          state["answered"])
        except Exception as exc:  # a transport error on a request we did not abandon is a loss
            outcome, kind = f"exception {exc!r}", "requests"
        if outcome.startswith("status 503") and "queue_full" in outcome:
            tally["busy"] += 1                                       # backpressure, said so plainly: not lost
        elif outcome.startswith("status 5"):
            tally["status_5xx"] += 1
            problems.append(outcome)
        elif outcome in ("finished", "left", "refused"):
            tally[kind] += 1
        else:
            tally["lost" if kind != "bad_inputs" else "bad_answered_wrong"] += 1
            problems.append(outcome)


def read_metrics(url: str) -> dict:
    values = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("nanoserve:") and "{" in line:
            name = line.split("{", 1)[0].removeprefix("nanoserve:")
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


def wait_drained(url: str, timeout: float = 60) -> dict:
    """Aborts land a step after the hang-up: wait until nothing runs, waits or holds a block."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url)
        idle = m["num_requests_running"] == m["num_requests_waiting"] == m["requests_in_flight"] == 0
        if (idle and m["num_free_blocks"] == m["num_total_blocks"]) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


CLIENT_TIMEOUT_S = 1800
TALLY = ["requests", "heavy", "disconnects", "bad_inputs", "busy", "lost", "bad_answered_wrong", "status_5xx"]


async def soak(url: str, seconds: float, concurrency: int, seed: int) -> tuple[dict, list, dict]:
    tally, problems = dict.fromkeys(TALLY, 0), []
    state = {"answered": [], "gaps": [], "refused_by_field": collections.Counter()}
    deadline = time.monotonic() + seconds
    # A client drops an idle connection before the server's --timeout-keep-alive (5 s) can: at equal
    # timeouts a request sent on a connection the server is closing fails (ReadError), which is the
    # client's race, not a lost request.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency, keepalive_expiry=1.0)
    # Closed-loop clients wait their turn: with 200 of them on a loaded 2-core machine a request queues
    # for minutes (the server answered ~0.85 requests/s at a load average of 20), so the patience
    # is CLIENT_TIMEOUT_S; a request not answered by then is counted lost.
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S, limits=limits) as http:
        await asyncio.gather(*[client(http, random.Random(seed * 100_003 + i), deadline, tally, problems, state)
                               for i in range(concurrency)])
    return tally, problems, state


def offline_params(body: dict):
    """The offline engine's SamplingParams for a request body; None when its output is not reproducible
    (sampled without a seed)."""
    from llm import SamplingParams, StructuredOutputsParams
    temperature = body.get("temperature", 1.0)
    if temperature > 0 and body.get("seed") is None:
        return None
    so = body.get("structured_outputs")
    return SamplingParams(n=body.get("n", 1), temperature=temperature, seed=body.get("seed"),
                          max_tokens=body["max_tokens"], stop=body.get("stop"), ignore_eos=body.get("ignore_eos", False),
                          logit_bias={int(t): b for t, b in body["logit_bias"].items()} if "logit_bias" in body else None,
                          structured_outputs=StructuredOutputsParams(**so) if so else None)


def offline_oracle(answered: list, model: str | None, batch_invariant: bool, llm=None) -> tuple[int, list[str]]:
    """Every finished greedy or seeded answer against the offline engine's (LLM.generate, the same model,
    params and seed, its own roomy KV pool: no preemption). In batch-invariant mode (the soak's default)
    a row's tokens do not depend on its batch, its chunks or a recompute, so every token must be the
    same. All are generated in one batch; an answer that differs is asked again alone, and counts as
    altered only if it differs from that too (without the mode a batch of another size may round a
    near tie the other way). llm: an offline engine already loaded for this model (else one is built).
    Returns (requests checked, the altered ones described)."""
    from llm import LLM
    llm = llm or LLM(model, batch_invariant=batch_invariant)
    jobs, checked = [], 0                      # (prompt, params, the server's text of each of its samples)
    for path, body, texts in answered:
        params = offline_params(body)
        if params is None:
            continue
        checked += 1
        if path == "/v1/chat/completions":
            prompts = [llm.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)]
        else:
            prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        jobs += [(prompt, params, texts[i * params.n:(i + 1) * params.n]) for i, prompt in enumerate(prompts)]
    if not jobs:
        return 0, []
    batched = llm.generate([p for p, _, _ in jobs], [q for _, q, _ in jobs])
    wrong = []
    for (prompt, params, texts), out in zip(jobs, batched):
        if [c.text for c in out.outputs] != texts:
            alone = [c.text for c in llm.generate([prompt], params)[0].outputs]
            wrong += [f"{prompt!r} {params}: got {texts!r} under load, {alone!r} offline"] if alone != texts else []
    return checked, wrong


def run_soak(base_url: str, minutes: float, concurrency: int = 200, seed: int = 0, model: str | None = None,
             batch_invariant: bool = True, oracle=None, check_tokens: bool = True) -> dict:
    """Drive the server at base_url for `minutes`, then check that nothing was lost or leaked."""
    before = read_metrics(base_url)
    load = [round(os.getloadavg()[0], 1)]      # the machine is shared: its load is part of the result
    start = time.monotonic()
    tally, problems, state = asyncio.run(soak(base_url, minutes * 60, concurrency, seed))
    wall = time.monotonic() - start
    load.append(round(os.getloadavg()[0], 1))
    after = wait_drained(base_url)
    counts = {name: int(after[METRIC[name]] - before[METRIC[name]]) for name in COUNTERS}   # the load's alone
    checked, altered = offline_oracle(state["answered"], model, batch_invariant, oracle) if check_tokens else (0, [])
    sent = sum(tally[k] for k in TALLY)
    gaps = sorted(state["gaps"])
    return {**tally, "sent": sent, "wall_s": round(wall, 1), "concurrency": concurrency,
            "altered": len(altered), "checked_against_offline": checked,
            "load_average": load, "batch_invariant": batch_invariant,
            "finished_unchecked": len(state["answered"]) - checked,   # sampled without a seed: not reproducible
            "p99_inter_token_gap_s": round(gaps[int(0.99 * (len(gaps) - 1))], 3) if gaps else None,
            "p50_inter_token_gap_s": round(gaps[len(gaps) // 2], 3) if gaps else None,
            "preemptions": int(after["num_preemptions_total"] - before["num_preemptions_total"]),
            "refused_4xx_by_kind": dict(sorted(state["refused_by_field"].items())),
            "leaked_blocks": int(after["num_total_blocks"] - after["num_free_blocks"]),
            "still_running": int(after["num_requests_running"] + after["num_requests_waiting"]
                                 + after["requests_in_flight"]),
            "counters": counts,   # received <= sent: a client that gives up while still queued in its own
                                  # connection pool never reaches the server
            "counters_add_up": counts["received"] == sum(counts[k] for k in COUNTERS[1:]) and counts["received"] <= sent,
            "problems": (altered + problems)[:10]}


def passed(result: dict) -> bool:
    return (result["lost"] == result["bad_answered_wrong"] == result["leaked_blocks"] == result["still_running"] == 0
            and result["status_5xx"] == result["busy"] == result["altered"] == 0 and result["counters_add_up"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str, object]:
    port, log = free_port(), tempfile.TemporaryFile()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the repository root, where serve.py is
    proc = subprocess.Popen([sys.executable, "serve.py", "--host", "127.0.0.1", "--port", str(port), *extra],
                            cwd=here, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    log.seek(0)
    raise RuntimeError("serve.py did not become healthy:\n" + log.read().decode(errors="replace")[-3000:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Soak serve.py with hundreds of clients and check nothing is lost.")
    p.add_argument("--minutes", type=float, default=1.0, help="how long the load runs (the full soak: 10)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write <date>-<machine>-<commit>-soak.md (what this prints) and .json there, as bench.py does")
    p.add_argument("--concurrency", type=int, default=200, help="concurrent clients (default 200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="soak a running server (127.0.0.1 only) instead of starting serve.py")
    # 40MiB: ~56 blocks of SmolLM2 for up to 64 sequences of ~40 tokens (3 blocks each): the engine must preempt
    # --max-waiting: every client's sequences may queue, so backpressure (503) is not mistaken for a failure
    # --batch-invariant: a row's tokens do not depend on its batch, so the offline engine's must be the same
    p.add_argument("--server-args", default="--max-num-seqs 64 --kv-cache-memory 40MiB --max-waiting 2048 "
                                            "--batch-invariant",
                   help="flags for the serve.py this starts (default: a KV pool small enough to force preemption)")
    args = p.parse_args(argv)
    stdout = sys.stdout
    if args.out:
        sys.stdout = report.Tee(stdout)
    try:
        ok, result = soak_main(args)
    finally:
        printed, sys.stdout = getattr(sys.stdout, "copy", None), stdout
    if args.out:
        header = report.run_header("none", "auto")
        results = header | {"sizes": {"name": "soak"}, "command": "python bench.py soak " + " ".join(argv or []),
                            "soak": result}
        print("results: " + ", ".join(report.write_run(results, printed.getvalue(), args.out)))
    return 0 if ok else 1


def soak_main(args) -> tuple[bool, dict]:
    proc = None
    if args.url:
        assert httpx.URL(args.url).host in ("127.0.0.1", "localhost"), "the soak only drives 127.0.0.1"
        url = args.url
    else:
        proc, url, log = start_server(args.server_args.split())
    try:
        flags = args.server_args.split()
        model = flags[flags.index("--model") + 1] if "--model" in flags else None
        result = run_soak(url, args.minutes, args.concurrency, args.seed, model, "--batch-invariant" in flags)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            exit_code = proc.wait(timeout=60)
    if proc is not None:
        result["server_exit_code"] = exit_code
    print(f"\n### Soak: {args.minutes:g} min, {args.concurrency} concurrent clients on 127.0.0.1\n")
    keys = ["sent", "requests", "heavy", "disconnects", "bad_inputs", "busy", "status_5xx", "lost", "altered", "checked_against_offline",
            "bad_answered_wrong", "leaked_blocks", "still_running", "preemptions", "p50_inter_token_gap_s",
            "p99_inter_token_gap_s", "counters_add_up", "wall_s"]
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    print("| " + " | ".join(str(result[k]) for k in keys) + " |")
    print(f"\n4xx by kind (status and field): {result['refused_4xx_by_kind']}")
    print(f"finished greedy or seeded requests checked against the offline engine: {result['checked_against_offline']}"
          f" ({result['finished_unchecked']} sampled without a seed left unchecked)")
    print(f"load average (1 min) at start and end: {result['load_average']} on {os.cpu_count()} CPUs")
    print(f"/metrics deltas: {result['counters']}")
    for problem in result["problems"]:
        print("problem:", problem)
    ok = passed(result) and result.get("server_exit_code", 0) == 0
    print("\nsoak:", "PASSED" if ok else "FAILED")
    return ok, result


if __name__ == "__main__":
    sys.exit(main())
