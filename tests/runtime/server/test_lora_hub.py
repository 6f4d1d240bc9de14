"""hf:// LoRA adapters through the real server, from a fake Hub on loopback (the real huggingface_hub client).

The PEFT adapters of the other LoRA tests, each published as a repository of its own. A pod downloads an
hf:// adapter itself, when it first needs it: one listed at start (preloaded), one loaded through the API
at a pinned commit; each serves PEFT's greedy tokens. Host memory holds one adapter, so switching between
them evicts and reloads — from the pod's verified entry, with no second download. A repository that does
not exist, or is not an adapter, is a 400 naming why; a Hub that cannot be reached is a 503 with Retry-After
and the error code routers read as the request's trouble, not the pod's; nothing changes either way and
the adapters fetched before keep serving.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from tokenfleet.runtime.errors import AdapterUnavailable

from ..hub_client import FakeHub, FakeRepo, client_pointed_at, serve_hub
from ..lora_adapters import peft_greedy
from .test_lora_server import MAX_NEW, complete, metric, post, start_lora_server

PROMPT = "The capital of France is"
COMMITS = {"qv8": "1" * 40, "mlp4": "2" * 40}
WEIGHTS = "adapter_model.safetensors"


def _repo(folder: Path, commit: str) -> FakeRepo:
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    assert {"adapter_config.json", WEIGHTS} <= set(files)
    return FakeRepo(commit, files, frozenset({WEIGHTS}))


@pytest.fixture(scope="module")
def hub_server(lora_adapters, tmp_path_factory):
    _, paths = lora_adapters
    repos = {f"org/{name}": _repo(paths[name], commit) for name, commit in COMMITS.items()}
    # A repository that is not an adapter (a model's config and nothing else).
    repos["org/not-an-adapter"] = FakeRepo("3" * 40, {"config.json": b'{"model_type": "llama"}'}, frozenset())
    hub = FakeHub(repos)
    http = serve_hub(hub)
    tmp = tmp_path_factory.mktemp("lora_hub")
    with pytest.MonkeyPatch.context() as mp, client_pointed_at(mp, hub.url, tmp):
        server = start_lora_server(
            max_loras=1,
            max_cpu_loras=1,
            download_dir=str(tmp / "adapters"),
            modules=[{"name": "qv8", "path": "hf://org/qv8"}],
        )
        yield hub, http, server
        server.stop()
    http.shutdown()
    http.server_close()


@pytest.fixture(scope="module")
def oai(hub_server) -> openai.OpenAI:
    _, _, server = hub_server
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _expected(lora_adapters, hf_tokenizer, adapter: str | None) -> str:
    peft_model, _ = lora_adapters
    return hf_tokenizer.decode(peft_greedy(peft_model, adapter, hf_tokenizer.encode(PROMPT), MAX_NEW))


def test_hub_adapters_serve_peft_tokens_and_reload_without_downloading(
    hub_server, oai, lora_adapters, hf_tokenizer
):
    hub, _, server = hub_server
    # Listed at start: downloaded and loaded before the server took requests.
    assert hub.gets(WEIGHTS) == 1
    models = {m.id: m for m in oai.models.list().data}
    assert models["qv8"].root == "hf://org/qv8"  # the source the user gave, not the pod's cache path
    assert complete(oai, "qv8", PROMPT).choices[0].text == _expected(lora_adapters, hf_tokenizer, "qv8")

    source = f"hf://org/mlp4@{COMMITS['mlp4']}"
    status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "m4", "lora_path": source})
    assert status == 200, text
    assert hub.gets(WEIGHTS) == 2
    assert complete(oai, "m4", PROMPT).choices[0].text == _expected(lora_adapters, hf_tokenizer, "mlp4")

    # One adapter fits in host memory: each switch evicts the other and loads it again — from the entry.
    api_calls = hub.requests["GET", "api"]
    for name, peft_name in [("qv8", "qv8"), ("m4", "mlp4"), ("qv8", "qv8")]:
        assert complete(oai, name, PROMPT).choices[0].text == _expected(
            lora_adapters, hf_tokenizer, peft_name
        )
    assert hub.gets(WEIGHTS) == 2 and hub.requests["GET", "api"] == api_calls
    # qv8, m4, then the three reloads: counted on /metrics with the engine's next stats (within a second).
    deadline = time.monotonic() + 10
    while metric(server, "tokenfleet:lora_adapter_loads_total", 'level="host"') < 5:
        assert time.monotonic() < deadline, "the reloads are not counted on /metrics"
        time.sleep(0.2)


def test_a_repository_that_is_missing_or_no_adapter_is_a_400_and_changes_nothing(hub_server, oai):
    _, _, server = hub_server
    before = {m.id for m in oai.models.list().data}
    for source, needle in [
        ("hf://org/missing", "repository not found"),
        ("hf://org/not-an-adapter", "adapter_config.json"),
        (f"hf://org/qv8@{'9' * 40}", "revision"),
    ]:
        status, text = post(server, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": source})
        error = json.loads(text)["error"]
        assert status == 400 and needle in error["message"] and error["param"] == "lora_path", text
    assert {m.id for m in oai.models.list().data} == before


def test_an_unreachable_hub_is_a_503_with_retry_after_and_fetched_adapters_keep_serving(
    hub_server, oai, lora_adapters, hf_tokenizer
):
    hub, _, server = hub_server
    hub.repos["org/late"] = hub.repos["org/qv8"]
    # The Hub goes away: its address answers nothing (a port just closed; the fake's own server would keep
    # answering on the client's pooled connections).
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{closed.getsockname()[1]}"
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "ENDPOINT", gone)
        mp.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", gone + "/{repo_id}/resolve/{revision}/{filename}"
        )
        _unreachable(server, oai)
    # Fetched before the outage: both still served (each evicting the other), and so is the base model.
    for name, peft_name in [("m4", "mlp4"), ("qv8", "qv8")]:
        assert complete(oai, name, PROMPT).choices[0].text == _expected(
            lora_adapters, hf_tokenizer, peft_name
        )
    assert complete(oai, "smollm2-135m-instruct", PROMPT).choices[0].finish_reason == "length"


def _unreachable(server, oai) -> None:
    req = urllib.request.Request(
        server.url + "/v1/load_lora_adapter",
        json.dumps({"lora_name": "late", "lora_path": "hf://org/late"}).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=120)
    body = json.loads(err.value.read())
    assert err.value.code == 503 and int(err.value.headers["Retry-After"]) >= 1
    assert (
        body["error"]["code"] == AdapterUnavailable.code
        and "cannot be downloaded now" in body["error"]["message"]
    )
    assert "late" not in {m.id for m in oai.models.list().data}
