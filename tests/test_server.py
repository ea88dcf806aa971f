"""The OpenAI-compatible server (chapter 6), tested against real server subprocesses on 127.0.0.1 with the bundled
SmolLM2-135M, through the `openai` SDK and raw httpx. Offline `LLM.generate` is the oracle for what the server must answer."""
import asyncio, json, os, socket, subprocess, sys, time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI, APIStatusError
from prometheus_client.parser import text_string_to_metric_families

from mini_infer.engine.llm import LLM
from mini_infer.engine.sampling import SamplingParams

MODEL = "smollm2-135m"
MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _start(tmp_path_factory, **kw):
    "Start `serve(...)` in a subprocess and wait for /health; yields the base URL."
    port, logdir = _free_port(), tmp_path_factory.mktemp("server")
    args = ", ".join(f"{k}={v!r}" for k, v in dict(model=MODEL, port=port, log_level="warning", **kw).items())
    log = open(logdir / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-c", f"from mini_infer.serve.server import serve; serve({args})"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "MINI_INFER_API_KEY": ""})
    url, t0 = f"http://127.0.0.1:{port}", time.time()
    while True:
        if proc.poll() is not None: raise RuntimeError("server exited:\n" + (logdir / "server.log").read_text())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200: break
        except httpx.HTTPError: pass
        if time.time() - t0 > 180: proc.kill(); raise RuntimeError("server did not start:\n" + (logdir / "server.log").read_text())
        time.sleep(0.2)
    return proc, url


_PROCS = {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc, url = _start(tmp_path_factory, max_num_seqs=64)
    _PROCS[url] = proc
    yield url
    proc.terminate(); proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server): return OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def llm(): return LLM(MODEL)


def greedy(n): return SamplingParams(temperature=0, max_tokens=n)

COLORS = "The three primary colors are"
SEEDED = "Once upon a time"
CONCURRENT = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(32)]


@pytest.fixture(scope="module")
def ref(llm):
    "Every offline reference the tests need, from one batched `LLM.generate` call."
    jobs = {"chat": (llm.tokenizer.encode_chat(MSGS), greedy(8)), "colors": (COLORS, greedy(12)),
            **{f"seeded{i}": (SEEDED, SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8)) for i in range(3)},
            **{f"q{i}": (p, greedy(8)) for i, p in enumerate(CONCURRENT)}}
    outs = llm.generate([p for p, _ in jobs.values()], [sp for _, sp in jobs.values()])
    return dict(zip(jobs, outs))


def metrics(url) -> dict:
    "/metrics parsed by prometheus_client: {sample name (+ sorted labels): value}."
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples: out[s.name + ("" if not s.labels else str(sorted(s.labels.items())))] = s.value
    return out


def test_health_and_models(server, client):
    assert httpx.get(server + "/health").status_code == 200
    assert [m.id for m in client.models.list()] == [MODEL]


def test_chat(client, llm, ref):
    ref = ref["chat"]
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text and r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode_chat(MSGS)) == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids) and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream(client, ref):
    ref = ref["chat"]
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format(server):
    with httpx.stream("POST", server + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [l for l in r.iter_lines() if l]
    assert all(l.startswith("data: ") for l in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(l[6:]) for l in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_completions_text_and_token_ids(client, ref):
    prompt, ref = COLORS, ref["colors"]
    by_text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0)
    for r in (by_text, by_ids):
        assert r.choices[0].text == ref.text and r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.token_ids)
    stream = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in stream if c.choices) == ref.text


def test_n_and_seed(client, ref):
    prompt = SEEDED
    r1 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
    r2 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert [c.index for c in r1.choices] == [0, 1, 2]
    assert [c.text for c in r1.choices] == [c.text for c in r2.choices]  # reproducible
    ref = [ref[f"seeded{i}"] for i in range(3)]
    assert [c.text for c in r1.choices] == [o.text for o in ref]  # choice i is seeded with seed + i
    assert r1.usage.prompt_tokens == len(ref[0].prompt_token_ids)  # the prompt counts once
    assert r1.usage.completion_tokens == sum(len(o.token_ids) for o in ref)
    # streaming n > 1: every choice index streams and finishes
    chunks = list(client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, temperature=1.0, seed=1, n=2, stream=True))
    assert sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason) == [0, 1]


def test_stop(client, ref):
    prompt, full = COLORS, ref["colors"].text
    stop = full.strip().split()[2]  # a word in the middle of the greedy answer
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop)
    assert r.choices[0].text == full[:full.index(stop)]


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True) and abs(tops[0] - t.logprob) < 1e-4  # greedy picks the top token
        assert t.token == t.top_logprobs[0].token and bytes(t.bytes).decode(errors="replace") == t.token
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == r.usage.completion_tokens
    assert all(1 <= len(d) <= 2 for d in lp.top_logprobs)
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


JAPANESE = "日本語"  # SmolLM2 splits two of its three characters across tokens


def test_logprob_bytes_rebuild_split_characters(llm):
    "Chat logprobs' `bytes` are each token's raw bytes: joined, they are the text's UTF-8, split characters included."
    from types import SimpleNamespace
    from mini_infer.serve.openai_api import chat_logprobs
    ids = llm.tokenizer.encode(JAPANESE + " and café <|im_end|>")
    assert any(llm.tokenizer.decode([i]) == "\ufffd" for i in ids)   # a token alone is half a character
    lps = [SimpleNamespace(token_id=i, logprob=-0.5, top={i: -0.5}) for i in ids]
    content = chat_logprobs(llm.tokenizer, lps)["content"]
    assert b"".join(bytes(e["bytes"]) for e in content).decode() == JAPANESE + " and café <|im_end|>"
    assert all(e["bytes"] == e["top_logprobs"][0]["bytes"] for e in content)


def test_logprob_bytes_over_the_wire(client):
    "The same through the server: an answer held to one choice (chapter 10's grammars), its tokens' bytes joined."
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Japanese, in Japanese?"}],
                                       max_tokens=12, temperature=0, logprobs=True,
                                       extra_body={"structured_outputs": {"choice": [JAPANESE]}})
    content = r.choices[0].logprobs.content
    if content[-1].token in ("<|im_end|>", "<|endoftext|>"):   # the stop token: in the logprobs, not the text
        content = content[:-1]
    assert r.choices[0].message.content == JAPANESE and len(content) > len(JAPANESE)
    assert "\ufffd" in [t.token for t in content]   # some token alone is part of a character
    assert b"".join(bytes(t.bytes) for t in content) == JAPANESE.encode()


def test_concurrent_greedy_clients_match_offline(server, ref):
    prompts, outs = CONCURRENT, [ref[f"q{i}"] for i in range(32)]
    ref = [o.text for o in outs]
    before = metrics(server)

    async def one(c, p):
        text = ""
        async for ch in await c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, stream=True):
            if ch.choices: text += ch.choices[0].text
        return text

    async def main():
        async with AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*[one(c, p) for p in prompts])
    got = asyncio.run(main())
    assert got == ref
    after = metrics(server)
    gen = after["mini_infer_generation_tokens_total"] - before["mini_infer_generation_tokens_total"]
    steps = after["mini_infer_engine_steps_total"] - before["mini_infer_engine_steps_total"]
    assert gen == sum(len(o.token_ids) for o in outs) and gen / steps > 4  # clients shared forward passes


def _wait_idle(url, timeout=20):
    t0 = time.time()
    while True:
        m = metrics(url)
        if m["mini_infer_num_requests_running"] == 0 and m["mini_infer_num_requests_waiting"] == 0: return m
        assert time.time() - t0 < timeout, m
        time.sleep(0.05)


def test_disconnect_frees_blocks(server):
    base = _wait_idle(server)
    # a prompt of several full blocks: leaving, the request returns them to the prefix cache, not just to the free list
    body = {"prompt": "Count from one to one thousand, one number per line. " * 5, "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        # Keep the line iterator referenced: a generator dropped mid-stream (`break` out of a for loop) is closed at
        # once, and httpcore then closes the connection, so the server would see the client leave before /metrics.
        lines = r.iter_lines()
        events = [json.loads(l[6:]) for l in (next(lines) for _ in range(6)) if l]
        assert len(events) == 3 and all(e["choices"][0]["finish_reason"] is None for e in events), events
        assert metrics(server)["mini_infer_kv_blocks_used"] > base["mini_infer_kv_blocks_used"]
    m = _wait_idle(server)
    assert m["mini_infer_kv_blocks_used"] == base["mini_infer_kv_blocks_used"]
    assert m["mini_infer_kv_blocks_cached"] >= base["mini_infer_kv_blocks_cached"] + 3
    aborted = "mini_infer_request_success_total[('finished_reason', 'abort')]"
    assert m[aborted] == base[aborted] + 1
    # non-streaming client that times out and goes away is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server + "/v1/completions", json={**body, "stream": False}, timeout=1.0)
    m = _wait_idle(server)
    assert m["mini_infer_kv_blocks_used"] == base["mini_infer_kv_blocks_used"] and m[aborted] == base[aborted] + 2


_CHAT = {"messages": MSGS, "max_tokens": 2}
BAD = [  # (path, body, status, param)
    ("/v1/chat/completions", {**_CHAT, "temperature": 2.5}, 400, "temperature"),
    ("/v1/chat/completions", {**_CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**_CHAT, "stop": 5}, 400, "stop"),
    ("/v1/chat/completions", {**_CHAT, "seed": 2**70}, 400, "seed"),
    ("/v1/chat/completions", b'{"messages": [], "temperature": NaN}', 400, None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", b"", 400, None),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": "10"}, 400, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**_CHAT, "top_p": 2}, 400, "top_p"),
    ("/v1/chat/completions", {**_CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {**_CHAT, "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {**_CHAT, "model": "gpt-4o"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("/v1/chat/completions", {**_CHAT, "tools": [{"type": "web_search"}]}, 400, "tools[0]"),  # chapter 10
    ("/v1/chat/completions", {**_CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {**_CHAT, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    ("/v1/chat/completions", {**_CHAT, "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("/v1/chat/completions", {**_CHAT, "logit_bias": {"1": 5}}, 400, "logit_bias"),
    ("/v1/chat/completions", {**_CHAT, "use_beam_search": True}, 400, "use_beam_search"),
    ("/v1/chat/completions", {**_CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ("/v1/chat/completions", {**_CHAT, "chat_template_kwargs": {"messages": []}}, 400, "chat_template_kwargs"),
    ("/v1/chat/completions", {**_CHAT, "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/chat/completions", {**_CHAT, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("/v1/chat/completions", {**_CHAT, "truncate_prompt_tokens": -2}, 400, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {**_CHAT, "stop_token_ids": ["a"]}, 400, "stop_token_ids.0"),
    ("/v1/chat/completions", {**_CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**_CHAT, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 100_000}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 9}, 400, "logprobs"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1] * 9000}, 400, "prompt"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": 5}, 400, "cache_salt"),
    ("/v1/chat/completions", {**_CHAT, "cache_salt": ""}, 400, "cache_salt"),
    ("/v1/chat/completions", {**_CHAT, "cache_salt": ["a"]}, 400, "cache_salt"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{p.split('/')[-1]}" for i, (p, *_) in enumerate(BAD)])
def test_bad_requests(server, path, body, status, param):
    r = httpx.post(server + path, content=body if isinstance(body, bytes) else json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    if param: assert err["param"] == param, err
    if body == {"prompt": [1] * 9000}: assert err["code"] == "context_length_exceeded"


def test_bad_requests_do_not_hurt(server, client):
    with pytest.raises(APIStatusError) as e:
        client.chat.completions.create(model=MODEL, messages=MSGS, temperature=5.0, max_tokens=2)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    r = httpx.get(server + "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(server + "/v1/chat/completions").status_code == 405
    big = {"prompt": "x" * (3 * 2**20)}
    assert httpx.post(server + "/v1/completions", json=big).status_code == 413

    def chunks():  # no Content-Length: the limit is enforced on what arrives
        for _ in range(40): yield b"x" * 2**16
    r = httpx.post(server + "/v1/completions", content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text  # still serving
    assert httpx.get(server + "/health").status_code == 200


def test_idle_server_does_not_spin(server):
    psutil = pytest.importorskip("psutil")
    _wait_idle(server)
    p = psutil.Process(_PROCS[server].pid)
    t0 = sum(p.cpu_times()[:2]); time.sleep(1.0)
    assert sum(p.cpu_times()[:2]) - t0 < 0.1  # the engine thread sleeps on a condition variable


def test_bench_serve(server, tmp_path):
    from mini_infer.bench.serve import run_bench_serve
    s = run_bench_serve(server, None, num_prompts=4, input_len=8, output_len=4, request_rate=50.0, slo_ttft_ms=60_000,
                        save_json=str(tmp_path / "b.json"), quiet=True, ignore_eos=True)
    assert (s["completed"], s["errors"], s["timeouts"]) == (4, 0, 0) and s["mean_output_tokens"] == 4
    # goodput is the throughput exactly: both are a count (the same) over the same duration
    assert s["goodput"] == s["request_throughput"] and s["ttft_ms"]["p50"] > 0 and s["tpot_ms"]["p99"] >= s["tpot_ms"]["p50"]
    assert json.loads((tmp_path / "b.json").read_text())["completed"] == 4
    plain = run_bench_serve(server, None, num_prompts=2, input_len=8, output_len=4, quiet=True)   # ignore_eos is opt-in
    assert (plain["completed"], plain["errors"]) == (2, 0) and plain["mean_output_tokens"] <= 4


def test_metrics(server):
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(server + "/metrics").text)}
    for name in ["num_requests_running", "num_requests_waiting", "kv_blocks_used", "kv_blocks_free", "num_preemptions",
                 "prompt_tokens", "generation_tokens", "engine_steps", "request_success",
                 "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"]:
        assert "mini_infer_" + name in fams, name
    assert fams["mini_infer_time_to_first_token_seconds"].type == "histogram" and fams["mini_infer_generation_tokens"].type == "counter"
    assert fams["mini_infer_num_requests_running"].type == "gauge"
    s = {x.name + str(sorted(x.labels.items())): x.value for f in fams.values() for x in f.samples}
    assert s["mini_infer_time_to_first_token_seconds_count[]"] > 0 and s["mini_infer_inter_token_latency_seconds_count[]"] > 0
    assert s["mini_infer_time_to_first_token_seconds_bucket[('le', '+Inf')]"] == s["mini_infer_time_to_first_token_seconds_count[]"]
    assert s["mini_infer_request_success_total[('finished_reason', 'length')]"] > 0
    assert s["mini_infer_generation_tokens_total[]"] > 0 and s["mini_infer_prompt_tokens_total[]"] > 0


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    proc, url = _start(tmp_path_factory, api_key="sekrit", max_num_seqs=1, max_waiting=2, enable_prefix_caching=False)
    yield url
    proc.terminate(); proc.wait(timeout=30)


def test_api_key(auth_server):
    assert httpx.get(auth_server + "/health").status_code == 200  # open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
        r = httpx.post(auth_server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(auth_server + "/v1/models", headers=headers).status_code == 401
    ok = OpenAI(base_url=auth_server + "/v1", api_key="sekrit", max_retries=0)
    assert ok.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(APIStatusError) as e:
        OpenAI(base_url=auth_server + "/v1", api_key="nope", max_retries=0).models.list()
    assert e.value.status_code == 401


def test_prefix_caching_can_be_turned_off(auth_server):
    ok = OpenAI(base_url=auth_server + "/v1", api_key="sekrit", max_retries=0)
    usages = [ok.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=2).usage for _ in range(2)]
    assert [u.prompt_tokens_details.cached_tokens for u in usages] == [0, 0]


def test_full_queue_answers_429(auth_server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            body = {"prompt": "Tell me a story", "max_tokens": 12, "ignore_eos": True}
            return await asyncio.gather(*[c.post(auth_server + "/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
                                          for _ in range(10)])
    rs = asyncio.run(main())
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 429 in codes and set(codes) == {200, 429}, codes
    err = next(r for r in rs if r.status_code == 429).json()["error"]
    assert err["type"] == "rate_limit_error"
    assert httpx.post(auth_server + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                      headers={"Authorization": "Bearer sekrit"}).status_code == 200


SYSTEM = ("You are a careful assistant for a library. You answer questions about opening hours, loans, renewals, fines, "
          "interlibrary requests and the reading rooms, briefly and politely, and you never invent a policy.")


def test_cached_tokens_on_a_repeated_system_prompt(server, client):
    def ask(q, **kw):
        return client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": q}], **kw)
    before = metrics(server)
    first, second = ask("When do you open?"), ask("Can I renew a loan online?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    chunks = list(ask("Where are the reading rooms?", stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    text = client.completions.create(model=MODEL, prompt=SYSTEM * 2, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=SYSTEM * 2, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16   # all but the last token's block
    m = metrics(server)
    assert m["mini_infer_prefix_cache_hits_total"] - before["mini_infer_prefix_cache_hits_total"] >= 2 * cached
    assert m["mini_infer_prefix_cache_queries_total"] > before["mini_infer_prefix_cache_queries_total"]


def test_salts_isolate_tenants(client):
    def ask(salt):
        r = client.completions.create(model=MODEL, prompt="Tenant secret: " + SYSTEM, max_tokens=2, extra_body={"cache_salt": salt})
        return r.usage.prompt_tokens_details.cached_tokens
    a1, a2, b1, b2 = ask("tenant-a"), ask("tenant-a"), ask("tenant-b"), ask("tenant-b")
    assert a1 == b1 == 0 and a2 == b2 > 0          # each tenant hits only its own blocks
    plain = client.completions.create(model=MODEL, prompt="Tenant secret: " + SYSTEM, max_tokens=2)
    assert plain.usage.prompt_tokens_details.cached_tokens == 0


def test_cached_tokens_with_n_choices(client):
    "n = 2 over a cached prefix: the prompt is counted once, with the tokens every choice found cached (each found the same)."
    prompt = "A question of its own about " + SYSTEM
    once = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert once.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    both = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, n=2, temperature=0.8, seed=1)
    full_blocks = (once.usage.prompt_tokens - 1) // 16 * 16
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks > 0
    assert both.usage.prompt_tokens == once.usage.prompt_tokens and len(both.choices) == 2
    assert both.usage.prompt_tokens_details.cached_tokens == full_blocks


# ---- vLLM's extras (issue 42): a body written for vLLM is served, and what the engine can honour, it does ----

VLLM_BODY = {  # a chat request as a client written for vLLM sends it (vLLM's documented extra parameters)
    "model": MODEL, "messages": MSGS, "max_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 3,
    "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "min_tokens": 12, "stop_token_ids": [],
    "include_stop_str_in_output": False, "ignore_eos": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "use_beam_search": False, "length_penalty": 1.0,
    "prompt_logprobs": None, "allowed_token_ids": None, "bad_words": [], "echo": False,
    "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": False,
    "chat_template_kwargs": {"enable_thinking": False}, "documents": None, "priority": 0,
    "request_id": "abc-123", "return_tokens_as_token_ids": False, "return_token_ids": True,
    "truncate_prompt_tokens": None, "structured_outputs": None, "logit_bias": None, "user": "u1",
    "kv_transfer_params": None, "vllm_xargs": {"tag": "x"}, "mm_processor_kwargs": {}, "cache_salt": "s1",
    "some_future_field": 1,  # unknown: ignored, as vLLM does
}


def test_vllm_style_body(server, llm):
    from mini_infer.plugins.structured import StructuredOutputsParams
    r = httpx.post(server + "/v1/chat/completions", json=VLLM_BODY, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] == "chatcmpl-abc-123"
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, top_k=20, min_p=0.05, repetition_penalty=1.05,
                            max_tokens=24, structured_outputs=StructuredOutputsParams(min_tokens=12))
    ref = llm.generate([llm.tokenizer.encode_chat(MSGS)], params)[0]  # the offline engine, same parameters
    assert body["choices"][0]["token_ids"] == ref.token_ids and body["choices"][0]["message"]["content"] == ref.text
    assert body["prompt_token_ids"] == ref.prompt_token_ids and len(ref.token_ids) >= 12


HI = [{"role": "user", "content": "Say hi."}]


def test_vllm_sampling_extras(client, llm):
    chat = lambda **kw: client.chat.completions.create(model=MODEL, messages=HI, **{"max_tokens": 60, "temperature": 0, **kw})
    greedy_ = chat(extra_body={"return_token_ids": True})
    ids, text = greedy_.choices[0].model_extra["token_ids"], greedy_.choices[0].message.content
    assert greedy_.choices[0].finish_reason == "stop" and len(ids) < 40
    longer = chat(extra_body={"min_tokens": len(ids) + 10})  # the stop token is banned until then
    assert longer.usage.completion_tokens >= len(ids) + 10 and longer.choices[0].message.content.startswith(text)
    cut = chat(extra_body={"stop_token_ids": [ids[2]], "return_token_ids": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["token_ids"] == ids[:3]
    assert chat(temperature=1.5, seed=5, extra_body={"top_k": 1}).choices[0].message.content == text
    penalised = chat(extra_body={"repetition_penalty": 1.3}).choices[0].message.content
    ref = llm.generate([llm.tokenizer.encode_chat(HI)], SamplingParams(temperature=0, max_tokens=60,
                                                                         repetition_penalty=1.3))[0]
    assert penalised == ref.text != text
    allowed = llm.tokenizer.encode(" hello world")
    only = chat(max_tokens=8, extra_body={"allowed_token_ids": allowed, "return_token_ids": True}).choices[0]
    assert set(only.model_extra["token_ids"]) <= set(allowed)
    as_ids = chat(max_tokens=2, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    assert as_ids.choices[0].logprobs.content[0].token == f"token_id:{ids[0]}"


def test_vllm_prompt_extras(client, llm):
    prompt = "The three primary colors are"
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    short = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"truncate_prompt_tokens": 3})
    assert short.usage.prompt_tokens == 3
    opened = [*MSGS, {"role": "assistant", "content": "The capital of France is"}]
    kw = dict(model=MODEL, messages=opened, max_tokens=6, temperature=0)
    cont = client.chat.completions.create(**kw, extra_body={"continue_final_message": True, "echo": True,
                                                            "add_generation_prompt": False, "return_token_ids": True})
    prompt_ids = cont.model_extra["prompt_token_ids"]
    assert llm.tokenizer.decode(prompt_ids, skip_special_tokens=False).endswith("The capital of France is")
    assert cont.choices[0].message.content.startswith("The capital of France is ")  # echoed, then continued
    streamed = client.chat.completions.create(**kw, stream=True, extra_body={"continue_final_message": True,
                                                                            "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cont.choices[0].message.content


def test_chat_template_kwargs(llm):
    "vLLM's chat_template_kwargs reach the template; a template that fails is a 400, and the server goes on."
    from types import SimpleNamespace
    from mini_infer.model.tokenizer import Tokenizer
    from mini_infer.serve.server import ServerThread, build_app
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if think %}<think>{% endif %}{% if strict %}{{ raise_exception('no strict mode') }}{% endif %}"
                "<|im_start|>assistant\n")
    tok = Tokenizer(llm.tokenizer.tok, template, eos_token="<|im_end|>")
    srv = ServerThread(build_app(SimpleNamespace(engine=llm.engine, tokenizer=tok, model_name=MODEL)))
    try:
        c = OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        ask = lambda kw: c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1, extra_body={
            "return_token_ids": True, **kw}).model_extra["prompt_token_ids"]
        assert "<think>" in tok.decode(ask({"chat_template_kwargs": {"think": True}}), skip_special_tokens=False)
        assert "<think>" not in tok.decode(ask({}), skip_special_tokens=False)
        with pytest.raises(APIStatusError) as e:
            ask({"chat_template_kwargs": {"strict": True}})
        assert e.value.status_code == 400 and "no strict mode" in e.value.message
        assert c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=1).choices[0].finish_reason
    finally:
        srv.stop()
