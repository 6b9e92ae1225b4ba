"""Tests of serve.py: a real `python serve.py` subprocess on 127.0.0.1 driven by the official
openai client and httpx, checked against the offline LLM (greedy outputs must match exactly);
plus in-process apps (starlette TestClient) over a wrapped engine for queue-full and step-failure paths."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # 2 shared cores: spinning OpenMP threads kill throughput

import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from engine import LLM, SamplingParams
from serve import build_app

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name three colors."}]


# ----------------------------------------------------------------------------- fixtures

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def booting_server():
    """`python serve.py` in a subprocess; it must exit 0 on SIGTERM."""
    port, log = free_port(), tempfile.TemporaryFile()
    # 128MiB holds ~2900 tokens: less than max_model_len, so the engine itself must reject bigger requests
    proc = subprocess.Popen([sys.executable, "serve.py", "--port", str(port), "--kv-cache-memory", "128MiB",
                             "--max-num-seqs", "64"], cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
    yield proc, f"http://127.0.0.1:{port}", log
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, server_log(log)


def server_log(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-4000:]


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="512MiB")


@pytest.fixture(scope="module")
def server(booting_server, llm):
    """Base URL of the healthy server (the offline llm loads while it boots)."""
    proc, url, log = booting_server
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, server_log(log)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    pytest.fail("server did not become healthy:\n" + server_log(log))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(llm, prompt, max_tokens, **kw) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return llm.generate(prompt, params)[0].outputs[0].text


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


# ----------------------------------------------------------------------------- the openai client

def test_completion_greedy_matches_offline(client, llm):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == greedy(llm, prompt, 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))


def test_completion_stream_equals_non_stream_with_usage(client, llm):
    prompt = "Once upon a time"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy(llm, prompt, 10)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_greedy_matches_offline_streamed_and_not(client, llm):
    expected = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == expected and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_list_of_prompts_times_n_indexes_like_openai(client, llm):
    prompts = ["One, two,", "Red, green,"]
    r = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    texts = [c.text for c in r.choices]
    assert texts == [greedy(llm, prompts[0], 6)] * 2 + [greedy(llm, prompts[1], 6)] * 2  # choice = prompt_i*n + j
    assert r.usage.completion_tokens == 24


def test_stop_string_cuts_output(client, llm):
    prompt = "Count: 1, 2, 3,"
    full = greedy(llm, prompt, 12)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed):
        r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=8, temperature=1.0,
                                      seed=seed, n=2)
        return [c.text for c in r.choices]
    first = sample(1234)
    assert sample(1234) == first
    assert first[0] != first[1]  # each of the n samples draws from its own stream


def test_echo_prepends_prompt(client, llm):
    r = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == "Hello there" + greedy(llm, "Hello there", 3)


def test_logprobs_in_both_formats(client):
    r = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and top[token] == logprob == max(top.values())  # greedy picks the top token
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    assert "".join(e.token for e in content) == c.choices[0].message.content


# ----------------------------------------------------------------------------- load and disconnects

async def stream_completion(http, prompt, max_tokens, hang_up_after):
    """Stream one completion; with hang_up_after=k, close the connection after k chunks (0: before any token)."""
    start, ttft, text, finish, chunks = time.perf_counter(), None, "", None, 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if hang_up_after is not None and chunks >= hang_up_after:
                return None  # leaving the block closes the unfinished response: a disconnect
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            ttft = ttft or time.perf_counter() - start
            text, finish, chunks = text + choice["text"], choice["finish_reason"], chunks + 1
    return text, finish, ttft


async def run_clients(url, prompts, max_tokens, hang_ups):
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=httpx.Limits(max_connections=100)) as http:
        return await asyncio.gather(*[stream_completion(http, p, max_tokens, hang_ups.get(i))
                                      for i, p in enumerate(prompts)])


def test_64_streams_with_disconnects_complete_and_free_every_block(server, llm):
    max_tokens = 12
    prompts = [f"Question {i}: what is {i} plus {3 * i}? Answer:" for i in range(64)]
    expected = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    rng = random.Random(7)
    hang_ups = {i: rng.randrange(0, max_tokens) for i in rng.sample(range(64), 12)}
    aborted_before = metric(httpx.get(server + "/metrics").text, "nanoserve:request_aborted_total")
    start = time.perf_counter()
    results = asyncio.run(run_clients(server, prompts, max_tokens, hang_ups))
    elapsed = time.perf_counter() - start
    for i, (result, want) in enumerate(zip(results, expected)):
        if i not in hang_ups:
            assert result[:2] == (want.outputs[0].text, "length"), f"client {i}"
    done = [r for r in results if r]
    ttfts = sorted(r[2] for r in done)
    print(f"\n64 streams ({len(done)} complete): {len(done) / elapsed:.2f} req/s, "
          f"{len(done) * max_tokens / elapsed:.1f} output tok/s, TTFT p50 {ttfts[len(ttfts) // 2]:.3f}s "
          f"p99 {ttfts[int(0.99 * (len(ttfts) - 1))]:.3f}s, wall {elapsed:.1f}s")
    text = assert_engine_drained(server)
    assert metric(text, "nanoserve:request_aborted_total") - aborted_before >= 6  # hang-ups seen mid-generation


def test_client_leaving_a_non_streamed_request_aborts_it(server):
    before = metric(httpx.get(server + "/metrics").text, "nanoserve:request_aborted_total")
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server + "/v1/completions", json={"prompt": "A long story:", "max_tokens": 2000,
                                                     "ignore_eos": True}, timeout=1.5)
    text = assert_engine_drained(server)
    assert metric(text, "nanoserve:request_aborted_total") == before + 1


def assert_engine_drained(url) -> str:
    """Aborts land on the step after the disconnect; within a few seconds nothing may be left."""
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(url + "/metrics").text
        state = [metric(text, "nanoserve:" + name) for name in
                 ("num_requests_running", "num_requests_waiting", "num_free_blocks", "num_total_blocks")]
        if state[0] == state[1] == 0 and state[2] == state[3] > 0:
            break
        assert time.monotonic() < deadline, f"running, waiting, free, total = {state}"
        time.sleep(0.2)
    assert metric(text, "nanoserve:time_to_first_token_seconds_count") > 0
    assert "nanoserve:e2e_request_latency_seconds_bucket" in text
    return text


# ----------------------------------------------------------------------------- bad input

OK_CHAT = [{"role": "user", "content": "hi"}]
BAD_INPUTS = [  # (path, body, status, param)
    ("/v1/completions", "{not json", 400, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "4"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * 9000}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10 ** 9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10 ** 9]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "seed": 2 ** 62}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "no_such_field": 1}, 400, "no_such_field"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "priority": 3}, 400, "priority"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": OK_CHAT, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", BAD_INPUTS)
def test_bad_input_gets_openai_error_naming_the_field(server, path, body, status, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server + path, content=content, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


def test_request_rejected_by_engine_fails_alone(server, client, llm):
    """max_tokens=4000 fits max_model_len (serve.py's check) but not the 128MiB KV cache: engine.add_request
    rejects it on the step thread. That request gets a 400; a concurrent one completes untouched."""
    prompt = "A short poem about the sea:"
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(lambda: list(client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True, extra_body={"ignore_eos": True})))
        time.sleep(0.3)
        bad = httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 4000})
        chunks = good.result()
    assert bad.status_code == 400 and "can never fit the KV cache" in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "prompt"
    assert "".join(c.choices[0].text for c in chunks) == greedy(llm, prompt, 16)


def test_models_and_health(server):
    assert httpx.get(server + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(server + "/health").status_code == 200
    assert httpx.get(server + "/v1/nothing").json()["error"]["type"] == "not_found_error"


# ----------------------------------------------------------------------------- faults, in-process

class WrappedEngine:
    """Test double around the real engine: step() can be held at a gate or made to raise."""

    def __init__(self, engine):
        self.engine, self.gate, self.failures_left = engine, threading.Event(), 0
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        self.gate.wait()
        if self.failures_left:
            self.failures_left -= 1
            raise RuntimeError("injected step failure")
        return self.engine.step()


def test_full_waiting_queue_gets_503_with_retry_after(llm):
    engine = WrappedEngine(llm.engine)
    engine.gate.clear()  # the first admitted request holds the step thread, the next ones queue up
    with TestClient(build_app(engine, MODEL, max_waiting=2)) as http, ThreadPoolExecutor(6) as pool:
        posts = [pool.submit(http.post, "/v1/completions", json={"prompt": f"Hi {i}", "max_tokens": 2})
                 for i in range(6)]
        deadline = time.monotonic() + 30
        while sum(p.done() for p in posts) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.gate.set()
        responses = [p.result() for p in posts]
    rejected = [r for r in responses if r.status_code == 503]
    assert len(rejected) == 4 and sum(r.status_code == 200 for r in responses) == 2
    assert all(r.headers["Retry-After"] and r.json()["error"]["code"] == "queue_full" for r in rejected)
    assert not llm.engine.has_unfinished_requests()


def test_step_failure_fails_requests_then_repeated_failures_mark_unhealthy(llm):
    engine = WrappedEngine(llm.engine)
    engine.failures_left = 1
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    with TestClient(build_app(engine, MODEL)) as http:
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 500 and "injected step failure" in failed.json()["error"]["message"]
        ok = http.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == greedy(llm, "Hello", 3)
        assert http.get("/health").status_code == 200
        engine.failures_left = 10 ** 9
        assert [http.post("/v1/completions", json=body).status_code for _ in range(3)] == [500] * 3
        assert http.get("/health").status_code == 503
        assert http.post("/v1/completions", json=body).status_code == 503
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()


# ----------------------------------------------------------------------------- shutdown (last: stops the server)

def test_sigterm_finishes_in_flight_stream_and_exits_0(server, booting_server):
    proc = booting_server[0]
    body = {"prompt": "Once upon a time", "max_tokens": 8, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert json.loads(first[6:])["choices"][0]["text"] is not None
    assert "data: [DONE]" in rest  # graceful: the stream in flight still finishes
    assert proc.wait(timeout=10) == 0
