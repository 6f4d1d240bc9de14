"""LoRA adapters through the real server and the official `openai` client, against HF + PEFT.

The same adapters as the engine test (made with PEFT on the default model): an adapter loaded at start
and one loaded at runtime are served by name, concurrently with the base model, each token-identical to
PEFT; `/v1/models` lists them with their parent; a bad load changes nothing; an unloaded adapter is a 404
in OpenAI's shape; the LoRA gauge GIE-style schedulers read is on /metrics.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import torch
from tokenfleet.runtime.engine.async_engine import AsyncEngine
from tokenfleet.runtime.engine.engine_core import EngineCore
from tokenfleet.runtime.model import load_model

from ..lora_adapters import peft_greedy
from .conftest import ServerThread, real_config

BASE = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
MAX_NEW = 8


def start_lora_server(**lora) -> ServerThread:
    """The real server with the default model (fp32, torch attention) serving LoRA with these `lora` settings;
    the caller stops it."""
    config = real_config(
        model={"dtype": "float32", "attention_backend": "torch"}, lora={"enable": True, **lora}
    )
    model = load_model(config.model, torch.device("cpu"))  # its own: LoRA hooks its projections
    return ServerThread(config, lambda cfg: AsyncEngine(EngineCore(cfg, loaded=model))).start()


@pytest.fixture(scope="module")
def lora_server(lora_adapters):
    _, paths = lora_adapters
    server = start_lora_server(
        max_loras=2, max_cpu_loras=2, modules=[{"name": "qv8", "path": str(paths["qv8"])}]
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def expected_text(lora_adapters, hf_tokenizer, adapter: str | None, prompt: str) -> str:
    peft_model, _ = lora_adapters
    tokens = peft_greedy(peft_model, adapter, hf_tokenizer.encode(prompt), MAX_NEW)
    return hf_tokenizer.decode(tokens)


def complete(oai, model: str, prompt: str):
    return oai.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )


def test_models_lists_adapters_with_their_parent(oai, lora_server, lora_adapters):
    _, paths = lora_adapters
    models = {m.id: m for m in oai.models.list().data}
    assert set(models) == {BASE, "qv8"}
    assert models["qv8"].parent == BASE and models["qv8"].root == str(paths["qv8"])
    assert models[BASE].parent is None
    # What routers place by: the adapters loaded here (with their block-hash keys) and the room to load more
    # (max_cpu_loras 2, nothing in flight: both places free or idle).
    with urllib.request.urlopen(lora_server.url + "/load", timeout=30) as resp:
        load = json.loads(resp.read())
    assert set(load["lora_adapters"]) == {"qv8"} and load["lora_adapters"]["qv8"].startswith("qv8@")
    assert load["lora_room"] == 2


def test_base_and_adapters_concurrently_equal_peft(oai, lora_server, lora_adapters, hf_tokenizer):
    _, paths = lora_adapters
    status, text = post(
        lora_server, "/v1/load_lora_adapter", {"lora_name": "all16", "lora_path": str(paths["all16"])}
    )
    assert (status, text) == (200, "Success: LoRA adapter 'all16' added successfully.")
    jobs = [(model, prompt) for model in (BASE, "qv8", "all16") for prompt in PROMPTS]
    results: dict[tuple[str, str], object] = {}

    def run(job):
        results[job] = complete(oai, *job)

    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for (model, prompt), resp in results.items():
        adapter = None if model == BASE else model
        assert resp.model == model  # the response names what served it
        assert resp.choices[0].text == expected_text(lora_adapters, hf_tokenizer, adapter, prompt), (
            model,
            prompt,
        )
    assert len(results) == len(jobs)

    stream = oai.chat.completions.create(
        model="all16", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True
    )
    chunks = list(stream)
    assert chunks and all(c.model == "all16" for c in chunks)

    with urllib.request.urlopen(lora_server.url + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    assert 'lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics


def test_bad_loads_change_nothing_and_unloaded_is_404(oai, lora_server, lora_adapters, tmp_path):
    _, paths = lora_adapters
    before = {m.id for m in oai.models.list().data}
    for body, status, needle in [
        ({"lora_name": "bad", "lora_path": str(tmp_path / "nope")}, 400, "no such adapter path"),
        ({"lora_name": "qv8", "lora_path": str(paths["mlp4"])}, 400, "already been loaded"),
        ({"lora_name": "bad"}, 400, "lora_path"),
        ({"lora_name": BASE, "lora_path": str(paths["mlp4"])}, 400, "base model"),
    ]:
        got, text = post(lora_server, "/v1/load_lora_adapter", body)
        assert got == status and needle in json.loads(text)["error"]["message"], text
    assert {m.id for m in oai.models.list().data} == before

    evictions = "tokenfleet:lora_adapter_evictions_total"
    evicted = metric(lora_server, evictions, 'level="host"')
    status, _ = post(
        lora_server, "/v1/load_lora_adapter", {"lora_name": "tmp", "lora_path": str(paths["mlp4"])}
    )
    assert status == 200  # over max_cpu_loras: the least recently used idle adapter made room
    # Counted (its rate is the swap rate), on /metrics with the engine's next stats (idle: within a second).
    deadline = time.monotonic() + 10
    while metric(lora_server, evictions, 'level="host"') != evicted + 1:
        assert time.monotonic() < deadline, "the host eviction is not counted on /metrics"
        time.sleep(0.2)
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "tmp"})[0] == 200
    with pytest.raises(openai.NotFoundError) as err:
        complete(oai, "tmp", "hello")
    assert err.value.body["code"] == "model_not_found"
    status, text = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "tmp"})
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    # The server keeps serving the base model, and both earlier adapters: the one "tmp" evicted from host
    # memory is still known and is loaded again from its path by its next request.
    assert complete(oai, BASE, "hello").choices[0].finish_reason == "length"
    for name in ("qv8", "all16"):
        assert complete(oai, name, PROMPTS[0]).model == name


def test_an_edited_lora_modules_list_applies_live(oai, lora_server, lora_adapters, hf_tokenizer):
    """What the operator does when spec.adapters changes: the mounted config's lora.modules is rewritten and
    the pod follows it without a restart (the config watcher hands the change to `on_change`)."""
    import asyncio

    from tokenfleet.runtime.server.live_config import on_change_for

    _, paths = lora_adapters
    state = lora_server.state
    old = state.config
    lora = old.lora.model_copy(
        update={
            "modules": (old.lora.modules[0].model_copy(update={"name": "m4", "path": str(paths["mlp4"])}),)
        }
    )
    new = old.model_copy(update={"lora": lora})
    asyncio.run_coroutine_threadsafe(on_change_for(state)(old, new), lora_server.loop).result(60)
    ids = {m.id for m in oai.models.list().data}
    assert "m4" in ids and "qv8" not in ids
    resp = complete(oai, "m4", PROMPTS[0])
    assert resp.choices[0].text == expected_text(lora_adapters, hf_tokenizer, "mlp4", PROMPTS[0])
    with pytest.raises(openai.NotFoundError):
        complete(oai, "qv8", PROMPTS[0])


@pytest.fixture(scope="module")
def decode_server(lora_adapters):
    """A second pod for disaggregation: `same` names the weights the first pod loads under that name,
    `swapped` other weights than the first pod's."""
    _, paths = lora_adapters
    config = real_config(
        model={"dtype": "float32", "attention_backend": "torch"},
        lora={
            "enable": True,
            "max_loras": 2,
            "max_cpu_loras": 2,
            "modules": [
                {"name": "same", "path": str(paths["qv8"])},
                {"name": "swapped", "path": str(paths["mlp4"])},
            ],
        },
    )
    model = load_model(config.model, torch.device("cpu"))
    server = ServerThread(config, lambda cfg: AsyncEngine(EngineCore(cfg, loaded=model))).start()
    yield server
    server.stop()


def metric(server, name: str, labels: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") and labels in line
    )


def disaggregated(prefill, decode, model: str, prompt: str) -> dict:
    """A router's two calls: the prompt on `prefill` (max_tokens 1, its blocks held), the rest on `decode`."""
    body = {"model": model, "prompt": prompt, "temperature": 0}
    status, text = post(
        prefill, "/v1/completions", body | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert status == 200, text
    done = json.loads(text)["kv_transfer_params"]
    params = {"do_remote_prefill": True, **done}
    status, text = post(
        decode,
        "/v1/completions",
        body | {"max_tokens": MAX_NEW, "ignore_eos": True, "kv_transfer_params": params},
    )
    assert status == 200, text
    return json.loads(text)


def test_a_disaggregated_adapter_request_takes_its_prompt_kv_and_equals_peft(
    lora_server, decode_server, lora_adapters, hf_tokenizer
):
    """Prefill on one pod, decode on another, under an adapter: both pods hash the prompt's blocks with the
    adapter's key (name and weights digest), so the decode pod takes them instead of recomputing. A name
    that means other weights on the prefill pod is refused (recomputed), never used."""
    _, paths = lora_adapters
    for name, path in (("same", paths["qv8"]), ("swapped", paths["all16"])):
        status, text = post(lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        assert status == 200, text
    prompt = " ".join(PROMPTS) * 4  # several full blocks
    received = 'direction="received"'
    try:
        before = metric(decode_server, "tokenfleet:kv_transfer_blocks_total", received)
        out = disaggregated(lora_server, decode_server, "same", prompt)
        assert out["choices"][0]["text"] == expected_text(lora_adapters, hf_tokenizer, "qv8", prompt)
        blocks = len(hf_tokenizer.encode(prompt)) // lora_server.config.cache.block_size
        assert metric(decode_server, "tokenfleet:kv_transfer_blocks_total", received) - before >= blocks - 1
        assert metric(decode_server, "tokenfleet:kv_transfer_fallbacks_total", "") == 0

        out = disaggregated(lora_server, decode_server, "swapped", prompt)
        assert out["choices"][0]["text"] == expected_text(lora_adapters, hf_tokenizer, "mlp4", prompt)
        assert metric(decode_server, "tokenfleet:kv_transfer_fallbacks_total", 'reason="refused"') == 1
    finally:
        for name in ("same", "swapped"):
            post(lora_server, "/v1/unload_lora_adapter", {"lora_name": name})
