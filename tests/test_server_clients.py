"""The server as real clients use it: lm-eval, the openai client's chat, a browser, Prometheus, OpenAPI.

    .venv/bin/pytest tests/test_server_clients.py -q            # -m "not slow" skips lm-eval and Chromium

The servers and the tiny random model come from test_server.py. The references are independent:
Transformers' forward and its apply_chat_template on the same saved model, gpt2 eval's own scoring
functions, engine.generate, prometheus_client's parser and jsonschema on the served /openapi.json.
lm-eval runs fully offline on three tasks from local JSONL files; Chromium is Debian's, driven by
Playwright (its own browser download is never used).
"""

import colorsys
import json
import os
import shutil
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from test_server import N_POSITIONS, PROMPTS, client, model, model_dir, reference, running_server, srv, tok  # noqa: F401

from gpt2 import GPT, GPTConfig
from gpt2.chat import DEFAULT_CHAT_TEMPLATE
from gpt2.config import GPT2_EOT
from gpt2.engine import generate
from gpt2.evaluate import score_continuations, sum_nll
from gpt2.tokenizer import Tokenizer

CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def eot_model_dir(tmp_path_factory):
    """A tiny random GPT-2 whose <|endoftext|> embedding is 30x longer, so that after an <|endoftext|>
    the greedy next token is <|endoftext|> again: the case lm-eval found (a document that ends in it).
    Saved with its tokenizer files, so lm-eval and Transformers load it offline."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, n_positions=N_POSITIONS, initializer_range=0.1))  # see test_server.py
    with torch.no_grad():
        m.transformer.wte.weight[GPT2_EOT] *= 30
    directory = tmp_path_factory.mktemp("tiny-eot")
    m.save_pretrained(str(directory))
    Tokenizer.gpt2().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def eot_model(eot_model_dir):
    return GPT.from_pretrained(str(eot_model_dir)).eval()


def hf_logprobs(directory, ids: list[int]) -> torch.Tensor:
    """Transformers' log-softmax at every position of ids: (T, V)."""
    from transformers import GPT2LMHeadModel
    hf = GPT2LMHeadModel.from_pretrained(str(directory)).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


# ---------------------------------------------------------------------------------------------
# legacy completions: the stop token's logprob entry, then lm-eval itself
# ---------------------------------------------------------------------------------------------

def test_echo_logprobs_give_the_stop_token_its_entry(eot_model_dir, eot_model, tok):
    prompt = "The end.<|endoftext|>"
    ids = tok.encode(prompt, allowed_special="all")
    logp = hf_logprobs(eot_model_dir, ids)  # (T, V)
    assert int(logp[-1].argmax()) == GPT2_EOT  # the case under test: the model's next token is the stop token
    ref = [float(logp[i - 1, ids[i]]) for i in range(1, len(ids))] + [float(logp[-1, GPT2_EOT])]
    with running_server(eot_model, tok) as s:
        body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
        choice = r["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"] == prompt and choice["finish_reason"] == "stop"  # nothing added to the text
        assert lp["tokens"] == [tok.decode([t]) for t in ids] + ["<|endoftext|>"]   # len(prompt) + 1 entries
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(ref, abs=1e-4)
        assert [list(top) for top in lp["top_logprobs"][1:]] == [[tok.decode([int(logp[i].argmax())])]
                                                                 for i in range(len(ids))]
        offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
        assert lp["text_offset"] == offsets + [len(prompt)]
        # streamed: the entry comes with the choice's last chunk
        body["stream"] = True
        with httpx.stream("POST", f"{s.url}/v1/completions", json=body, timeout=60) as resp:
            events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
        streamed = [x for e in events for x in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
        assert streamed == lp["tokens"] and "".join(e["choices"][0]["text"] for e in events) == prompt
        # max_tokens=0 with echo: the prompt's entries alone
        r = httpx.post(f"{s.url}/v1/completions", json={**body, "stream": False, "max_tokens": 0}, timeout=60).json()
        assert r["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(ref[:-1], abs=1e-4)
        assert len(r["choices"][0]["logprobs"]["tokens"]) == len(ids)


TASKS = {  # name: (output type, documents, task fields)
    "tiny_mc": ("multiple_choice",
                [{"question": "The sky is", "choices": ["blue", "green"], "gold": 0},
                 {"question": "Two plus two is", "choices": ["four", "five", "six"], "gold": 2}],
                {"doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}", "doc_to_target": "gold",
                 "metric_list": [{"metric": "acc"}]}),
    "tiny_ppl": ("loglikelihood_rolling",
                 [{"text": "It was a bright cold day in April, and the clocks were striking thirteen."},
                  {"text": "The end.<|endoftext|>"}],   # the model's next token after it is <|endoftext|>
                 {"doc_to_text": "", "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]}),
    "tiny_gen": ("generate_until",
                 [{"question": "Q: What is the capital of France?\nA:", "answer": " Paris"},
                  {"question": "Once upon a time", "answer": " there"}],
                 {"doc_to_text": "{{question}}", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "exact_match"}],
                  "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False, "temperature": 0}}),
}


def write_tasks(directory: Path) -> Path:
    """One lm-eval task YAML per TASKS entry, each over its own local JSONL file."""
    import yaml
    for name, (output_type, docs, fields) in TASKS.items():
        data = directory / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "output_type": output_type, **fields}
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return directory


@pytest.mark.slow
def test_lm_eval_local_completions_equals_gpt2_eval_and_transformers(eot_model_dir, eot_model, tok, tmp_path,
                                                                     monkeypatch):
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # everything is local; never try the network
        monkeypatch.setenv(var, "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager
    with running_server(eot_model, tok) as s:
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=list(TASKS), log_samples=True,
            model_args={"model": "tiny", "base_url": f"{s.url}/v1/completions", "tokenizer": str(eot_model_dir),
                        "tokenizer_backend": "huggingface", "max_length": N_POSITIONS, "max_retries": 1},
            task_manager=TaskManager(include_path=str(write_tasks(tmp_path))))
    samples = {name: sorted(out["samples"][name], key=lambda x: x["doc_id"]) for name in TASKS}
    encode = lambda text: tok.encode(text, allowed_special="all")

    # loglikelihood: (context, " choice") pairs, split as lm-eval splits them
    for sample in samples["tiny_mc"]:
        for (ctx, cont), [(got, got_greedy)] in zip(sample["arguments"], sample["resps"]):
            ctx_ids = encode(ctx)
            cont_ids = encode(ctx + cont)[len(ctx_ids):]
            [(ours, ours_greedy)] = score_continuations(eot_model, [(ctx_ids, cont_ids)])
            logp = hf_logprobs(eot_model_dir, ctx_ids + cont_ids)
            hf = sum(float(logp[len(ctx_ids) - 1 + i, t]) for i, t in enumerate(cont_ids))
            assert got == pytest.approx(ours, abs=1e-4) and got == pytest.approx(hf, abs=1e-4)
            assert got_greedy == ours_greedy
    # rolling loglikelihood: the whole document after <|endoftext|>, the sum gpt2 eval perplexity takes
    for sample, doc in zip(samples["tiny_ppl"], TASKS["tiny_ppl"][1]):
        ids = [GPT2_EOT] + encode(doc["text"])
        nll, count = sum_nll(eot_model, ids)
        logp = hf_logprobs(eot_model_dir, ids)
        hf = sum(float(logp[i - 1, ids[i]]) for i in range(1, len(ids)))
        assert count == len(ids) - 1
        assert sample["resps"][0][0] == pytest.approx(-nll, abs=1e-3) and sample["resps"][0][0] == pytest.approx(hf, abs=1e-3)
    # generate_until: greedy, cut at the first "\n"
    for sample, doc in zip(samples["tiny_gen"], TASKS["tiny_gen"][1]):
        ids = encode(doc["question"])
        text = tok.decode(generate(eot_model, [ids], max_new_tokens=8)[0]).split("\n")[0]
        from transformers import GPT2LMHeadModel
        hf = GPT2LMHeadModel.from_pretrained(str(eot_model_dir)).eval()
        hf_ids = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, pad_token_id=GPT2_EOT,
                             eos_token_id=GPT2_EOT)[0, len(ids):].tolist()
        hf_text = tok.decode([t for t in hf_ids if t != GPT2_EOT]).split("\n")[0]
        assert sample["resps"][0][0] == text == hf_text


# ---------------------------------------------------------------------------------------------
# chat
# ---------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, my dog"}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def transformers_chat_prompt(template: str, messages, directory: Path) -> str:
    """Transformers' own rendering of a chat template (its Jinja environment, not ours)."""
    from transformers import GPT2TokenizerFast
    hf = GPT2TokenizerFast.from_pretrained(str(Tokenizer.gpt2().save_pretrained(directory / "tokenizer")))
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


def test_chat_completions_with_the_openai_client(srv, model, tok, tmp_path):
    prompt = transformers_chat_prompt(DEFAULT_CHAT_TEMPLATE, MESSAGES, tmp_path)
    assert prompt == "System: You are terse.\n\nUser: Hello, my dog\n\nAssistant:"  # the documented format
    c = client(srv)
    r = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "tiny"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference(model, tok, prompt, 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == 12
    # streaming: the role first, then the content, then the reason; with a seed, n = 2
    chunks = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=10, n=2, seed=3,
                                            temperature=0.9, stream=True, stream_options={"include_usage": True}))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    for j in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == j]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(ch.delta.content or "" for ch in mine) == reference(model, tok, prompt, 10, temperature=0.9,
                                                                          seed=3 + j)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # a Jinja template file, rendered as Transformers renders it
    path = tmp_path / "chatml.jinja"
    path.write_text(CHATML)
    with running_server(model, tok, chat_template=str(path)) as s:
        r = client(s).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == reference(model, tok, transformers_chat_prompt(CHATML, MESSAGES, tmp_path), 8)
    # bad messages: OpenAI's errors
    for messages, status in [([], 422), ([{"role": "wizard", "content": "x"}], 422), ([{"role": "user"}], 422)]:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "tiny", "messages": messages}, timeout=30)
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------------------------------------
# connections: model names, slow senders, the cap, the KV limit
# ---------------------------------------------------------------------------------------------

def test_model_must_name_the_served_model_or_an_alias(model, tok):
    with running_server(model, tok, aliases=("gpt2-tiny",)) as s:
        c = client(s)
        assert [m.id for m in c.models.list().data] == ["tiny", "gpt2-tiny"]
        for name in ("tiny", "gpt2-tiny"):
            r = c.completions.create(model=name, prompt="hi", max_tokens=3, temperature=0)
            assert r.choices[0].text == reference(model, tok, "hi", 3)
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="gpt-4", prompt="hi", max_tokens=3)
        assert e.value.code == "model_not_found"
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"model": "gpt-4", "messages": MESSAGES}, timeout=30)
        assert r.status_code == 404 and r.json() == {"error": {
            "message": "The model `gpt-4` does not exist or you do not have access to it.",
            "type": "invalid_request_error", "param": None, "code": "model_not_found"}}


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_slow_senders_time_out(model, tok):
    with running_server(model, tok, request_timeout=1.0) as s:
        # a head sent a byte at a time, never finished
        with socket.create_connection(("127.0.0.1", s.port), timeout=20) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            start = time.monotonic()
            data = read_response(sock)  # until the server closes the connection
            assert time.monotonic() - start < 15
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
        # a whole head, then half the body
        with socket.create_connection(("127.0.0.1", s.port), timeout=20) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")
            data = read_response(sock)
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and json.loads(body)["error"]["code"] == "request_timeout"
        # prompt clients are served
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2,
                                                        "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(model, tok, "hi", 2)


def test_concurrent_connections_are_capped(model, tok):
    with running_server(model, tok, max_connections=2) as s:
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
        idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(2)]
        try:
            time.sleep(0.2)  # uvicorn registers them
            r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "too_many_connections"
        finally:
            idle.pop().close()
        time.sleep(0.2)
        try:
            assert httpx.post(f"{s.url}/v1/completions", json=body, timeout=30).status_code == 200
        finally:
            idle.pop().close()


def test_a_request_over_the_kv_limit_gets_429(model, tok):
    cfg = model.config
    token_bytes = 2 * cfg.n_layer * cfg.n_embd * 4  # keys and values, float32
    max_kv_mb = 48 * token_bytes / 2**20            # room for 48 positions
    with running_server(model, tok, max_kv_mb=max_kv_mb) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 100}, timeout=30)
        assert r.status_code == 429 and r.json()["error"]["code"] == "kv_limit" and r.headers["retry-after"] == "1"
        r = httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 8,
                                                        "temperature": 0}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference(model, tok, "hi", 8)


# ---------------------------------------------------------------------------------------------
# the API describes itself; metrics
# ---------------------------------------------------------------------------------------------

def test_openapi_schema_matches_what_the_endpoints_accept_and_return(srv):
    jsonschema = pytest.importorskip("jsonschema")
    api = httpx.get(f"{srv.url}/openapi.json", timeout=30).json()

    def validator(schema):  # refs (#/components/...) resolve against the whole document
        return jsonschema.Draft202012Validator({**schema, "components": api["components"]})

    def schema_of(path, status="200", content="application/json"):
        op = api["paths"][path]["post" if path.endswith("completions") else "get"]
        return validator(op["responses"][status]["content"][content]["schema"])

    requests = {"/v1/completions": {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "echo": True, "logprobs": 2,
                                    "n": 2, "seed": 1, "stop": ["\n"]},
                "/v1/chat/completions": {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "seed": 1}}
    for path, body in requests.items():
        request_schema = validator(api["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"])
        request_schema.validate(body)                               # what the server accepts ...
        assert not request_schema.is_valid({**body, "best_of": 2})  # ... and what it refuses (422)
        assert not request_schema.is_valid({**body, "max_tokens": "4"})
        assert httpx.post(f"{srv.url}{path}", json={**body, "best_of": 2}, timeout=30).status_code == 422
        r = httpx.post(f"{srv.url}{path}", json=body, timeout=60)
        schema_of(path).validate(r.json())
        with httpx.stream("POST", f"{srv.url}{path}", json={**body, "stream": True,
                                                              "stream_options": {"include_usage": True}}, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) > 3
        events = schema_of(path, content="text/event-stream")
        for line in lines[:-1]:
            events.validate(json.loads(line.removeprefix("data: ")))
        r = httpx.post(f"{srv.url}{path}", json={**body, "model": "nope"}, timeout=30)
        schema_of(path, "404").validate(r.json())
        r = httpx.post(f"{srv.url}{path}", json={**body, "temperature": 9}, timeout=30)
        schema_of(path, "422").validate(r.json())
    validator(api["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]).validate(
        httpx.get(f"{srv.url}/v1/models", timeout=30).json())
    # every field a request model has is in the schema, nothing more is allowed
    props = api["components"]["schemas"]["CompletionRequest"]
    assert props["additionalProperties"] is False and "logprobs" in props["properties"] and "echo" in props["properties"]


def test_metrics_in_the_prometheus_format(model, tok):
    from prometheus_client.parser import text_string_to_metric_families
    with running_server(model, tok) as s:
        c = client(s)
        usages = [c.completions.create(model="tiny", prompt=p, max_tokens=6, temperature=0, n=2, seed=1).usage
                  for p in PROMPTS[:2]]
        chunks = list(c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5, stream=True,
                                                stream_options={"include_usage": True}))
        usages.append(chunks[-1].usage)
        httpx.post(f"{s.url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
        text = httpx.get(f"{s.url}/metrics", timeout=30).text
        stats = s.scheduler.stats()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    value = lambda name, **labels: samples[(name, tuple(sorted(labels.items())))]
    assert value("gpt2_requests_total", endpoint="/v1/completions", status="200") == 2
    assert value("gpt2_requests_total", endpoint="/v1/completions", status="404") == 1
    assert value("gpt2_requests_total", endpoint="/v1/chat/completions", status="200") == 1
    assert value("gpt2_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    choices = 2 + 2 + 1
    assert value("gpt2_generation_tokens_total") == generated == 6 * 4 + 5
    assert value("gpt2_time_to_first_token_seconds_count") == choices
    assert value("gpt2_inter_token_latency_seconds_count") == generated - choices
    assert value("gpt2_time_to_first_token_seconds_bucket", le="+Inf") == choices
    assert value("gpt2_queue_depth") == 0 and value("gpt2_running_sequences") == 0
    assert value("gpt2_kv_cache_bytes") == stats["kv_bytes"] > 0
    assert value("gpt2_prefix_cache_bytes") == stats["prefix_cache_bytes"]


# ---------------------------------------------------------------------------------------------
# the playground, in Chromium
# ---------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_playground_streams_the_same_tokens_as_the_api_in_chromium(srv, tmp_path):
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"{CHROMIUM} is not installed")
    sync_api = pytest.importorskip("playwright.sync_api")
    html = httpx.get(f"{srv.url}/", timeout=30).text
    assert "http://" not in html and "https://" not in html  # self-contained: nothing from a CDN
    settings = {"temperature": 0.8, "top_p": 0.95, "max_tokens": 16, "seed": 5}
    api = httpx.post(f"{srv.url}/v1/completions", json={"model": "tiny", "prompt": PROMPTS[3], "logprobs": 5,
                                                       **settings}, timeout=60).json()["choices"][0]["logprobs"]
    requested = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 700})
            page.on("request", lambda req: requested.append(req.url))
            page.goto(f"{srv.url}/")
            page.fill("#prompt", PROMPTS[3])
            for name, value in settings.items():
                page.fill(f"#{name}", str(value))
            page.click("#go")
            page.wait_for_selector("body[data-state=done]", timeout=60_000)
            spans = page.eval_on_selector_all(
                "#output .tok", "s => s.map(x => [x.dataset.token, Number(x.dataset.logprob), x.style.background])")
            page.hover("#output .tok >> nth=2")
            tip = page.inner_text("#tip")
            page.screenshot(path=str(tmp_path / "playground.png"))
            if os.environ.get("GPT2_PLAYGROUND_SCREENSHOT"):  # a copy to look at
                shutil.copy(tmp_path / "playground.png", os.environ["GPT2_PLAYGROUND_SCREENSHOT"])
        finally:
            browser.close()
    assert [t for t, _, _ in spans] == api["tokens"]                      # the same tokens for the same seed
    assert [lp for _, lp, _ in spans] == pytest.approx(api["token_logprobs"], abs=1e-6)
    hues = [colorsys.rgb_to_hls(*(int(c) / 255 for c in bg[4:-1].split(",")))[0] for _, _, bg in spans]
    by_logprob = [h for _, h in sorted(zip([lp for _, lp, _ in spans], hues))]
    assert by_logprob == sorted(by_logprob) and by_logprob[-1] > by_logprob[0]  # likelier is greener
    alternatives = sorted(api["top_logprobs"][2].items(), key=lambda kv: -kv[1])
    assert len(alternatives) == 5 and len(tip.strip().splitlines()) == 5  # the top 5 on hover
    for token, _ in alternatives:
        assert json.dumps(token, ensure_ascii=False) in tip
    assert all(url.startswith(srv.url) for url in requested)
