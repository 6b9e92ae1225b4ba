"""
loadgen.py: an HTTP load generator that speaks exactly what `vllm bench serve --backend openai` sends.

It runs in its own process (`python loadgen.py --url ... --requests reqs.json --out result.json`), so
the client's JSON parsing and timing never share a GIL with the server under test, and the same client
drives serve.py and `vllm serve` alike. It uses aiohttp, as vLLM's client does: on 2 cores the client's
CPU time is taken from the server, and httpx cost 0.73-0.76 s of CPU per 32-request run against aiohttp's
0.44-0.47 s (serve.py gave 628-658 vs 661-697 tok/s under them, taking turns). Each request is a streaming
/v1/completions POST with vLLM's client's fields: model, prompt, repetition_penalty 1.0, max_tokens,
logprobs null, stream, stream_options.include_usage, ignore_eos when asked, plus any sampling fields
given (--temperature), and an x-request-id header. Arrivals are all at once (rate inf) or Poisson.
A chunk that carries a choice is a token's arrival, except a closing one with no text and a finish_reason
(llama-server ends every stream with one; counting it would add a near-zero gap to its ITL).
Owns the client and its metrics (output tok/s, TTFT, TPOT, ITL percentiles); it never starts servers.
"""
import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid

import aiohttp
import numpy as np

PERCENTILES = (50, 90, 99)


def payload(model, req, ignore_eos, extra):
    body = {"model": model, "prompt": req["prompt"], "repetition_penalty": 1.0, "max_tokens": req["output_len"],
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return body | extra


def is_token_chunk(data):
    """Does this parsed /v1/completions SSE chunk bring output: a choice with text, or one that does not end the
    stream (a token may decode to no text yet)?"""
    choices = data.get("choices")
    if not choices:
        return False                                  # the usage chunk, or a keep-alive
    c = choices[0]
    return bool(c.get("text")) or c.get("finish_reason") is None


async def one_request(session, url, body, request_id):
    """Send one streamed completion; the time of every chunk that carries a choice is a token arrival."""
    out = {"ttft": None, "itl": [], "latency": None, "output_tokens": None, "error": None}
    headers = {"x-request-id": request_id}
    if os.environ.get("OPENAI_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['OPENAI_API_KEY']}"
    t0 = last = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                out["error"] = f"HTTP {resp.status}: {(await resp.read())[:200].decode(errors='replace')}"
                return out
            async for line in resp.content:             # one SSE line at a time, as it arrives
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line.removeprefix(b"data: "))
                if is_token_chunk(data):
                    now = time.perf_counter()
                    if out["ttft"] is None:
                        out["ttft"] = now - t0
                    else:
                        out["itl"].append(now - last)
                    last = now
                if data.get("usage"):                   # llama-server sends it on the closing chunk
                    out["output_tokens"] = data["usage"].get("completion_tokens")
    except (aiohttp.ClientError, OSError, json.JSONDecodeError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    if out["ttft"] is None:
        out["error"] = "no chunk with a choice arrived"
    out["latency"] = last - t0
    return out


async def run(url, model, reqs, rate, seed, ignore_eos, extra):
    """Send every request at its arrival time (all at once for rate inf); gather each one's timings."""
    rng = np.random.default_rng(seed)
    prefix = f"bench-{uuid.uuid4().hex[:8]}-"
    connector = aiohttp.TCPConnector(limit=0)        # no cap on open connections, as vLLM's client without --max-concurrency
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600)) as session:
        tasks, start = [], time.perf_counter()
        for i, req in enumerate(reqs):
            tasks.append(asyncio.create_task(one_request(session, url, payload(model, req, ignore_eos, extra),
                                                         prefix + str(i))))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1 / rate))
        outs = await asyncio.gather(*tasks)
        return outs, time.perf_counter() - start


def summarize(reqs, outs, duration):
    """vLLM's client's arithmetic: output tok/s over the run; TPOT = (latency - TTFT) / (output tokens - 1)."""
    ok = [(r, o) for r, o in zip(reqs, outs) if o["error"] is None]
    errors = [o["error"] for o in outs if o["error"] is not None]
    tokens = [o["output_tokens"] if o["output_tokens"] is not None else r["output_len"] for r, o in ok]
    ttft = [o["ttft"] for _, o in ok]
    tpot = [(o["latency"] - o["ttft"]) / (n - 1) for (_, o), n in zip(ok, tokens) if n > 1]
    itl = [x for _, o in ok for x in o["itl"]]
    res = {"completed": len(ok), "failed": len(errors), "first_error": errors[0] if errors else None,
           "duration_s": duration, "output_tokens": sum(tokens), "output_tok_s": sum(tokens) / duration,
           "usage_reported": all(o["output_tokens"] is not None for _, o in ok)}
    for name, v in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for q in PERCENTILES:
            res[f"{name}_p{q}_s"] = float(np.percentile(v, q)) if v else float("nan")
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000/v1/completions")
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", required=True, help='JSON list of {"prompt", "output_len"}')
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson; inf: all at once")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=float, default=None, help="sent as a sampling field when given")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="write the summary (and per-request timings) here as JSON")
    args = ap.parse_args(argv)
    reqs = json.load(open(args.requests))
    extra = {} if args.temperature is None else {"temperature": args.temperature}
    random.seed(args.seed)
    outs, duration = asyncio.run(run(args.url, args.model, reqs, args.request_rate, args.seed, args.ignore_eos, extra))
    res = summarize(reqs, outs, duration)
    with open(args.out, "w") as f:
        json.dump(res | {"requests": outs}, f)
    print(json.dumps(res), file=sys.stderr)


if __name__ == "__main__":
    main()
