"""Pinned LoRA adapters through the real server: `POST /v1/pin_lora_adapter` keeps an adapter loaded for a
lease (what holds a deployment's minimum copies on the pods the operator chose): while pinned it is never
evicted for another adapter — the pod's room is 0 and the other adapter is refused with the 503 routers read
as "no room here" — and when the lease ends the other loads and serves PEFT's tokens."""

from __future__ import annotations

import json
import time
import urllib.request

import openai
import pytest

from ..lora_adapters import peft_greedy
from .test_lora_server import MAX_NEW, complete, post, start_lora_server

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def one_place_server(lora_adapters):
    _, paths = lora_adapters
    server = start_lora_server(
        max_loras=1,
        max_cpu_loras=1,  # one host place: loading one adapter evicts the other
        modules=[{"name": n, "path": str(paths[n])} for n in ("qv8", "mlp4")],
    )
    yield server
    server.stop()


def _load(server) -> dict:
    with urllib.request.urlopen(server.url + "/load", timeout=30) as resp:
        return json.loads(resp.read())


def _expected(lora_adapters, hf_tokenizer, adapter: str) -> str:
    peft_model, _ = lora_adapters
    return hf_tokenizer.decode(peft_greedy(peft_model, adapter, hf_tokenizer.encode(PROMPT), MAX_NEW))


def test_a_pinned_adapter_is_not_evicted_for_another_until_its_pin_ends(
    one_place_server, lora_adapters, hf_tokenizer
):
    server = one_place_server
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert complete(oai, "mlp4", PROMPT).choices[0].text == _expected(lora_adapters, hf_tokenizer, "mlp4")
    # The pin loads qv8 (evicting the idle mlp4) and holds it.
    status, text = post(server, "/v1/pin_lora_adapter", {"lora_name": "qv8", "seconds": 3})
    assert status == 200 and json.loads(text) == {"lora_name": "qv8", "pinned_seconds": 3.0}, text
    load = _load(server)
    assert (load["lora_slots"], load["lora_active"]) == (1, [])  # one adapter per step; none in flight now
    assert set(load["lora_adapters"]) == {"qv8"} and load["lora_room"] == 0 and load["lora_pinned"] == ["qv8"]
    with pytest.raises(openai.APIStatusError) as err:
        complete(oai, "mlp4", PROMPT)
    assert err.value.status_code == 503 and err.value.body["code"] == "lora_slots_busy"
    assert err.value.response.headers["Retry-After"]
    # The pinned adapter itself serves as ever.
    assert complete(oai, "qv8", PROMPT).choices[0].text == _expected(lora_adapters, hf_tokenizer, "qv8")
    deadline = time.monotonic() + 15
    while _load(server)["lora_pinned"]:
        assert time.monotonic() < deadline, "the pin never ended"
        time.sleep(0.2)
    assert _load(server)["lora_room"] == 1
    assert complete(oai, "mlp4", PROMPT).choices[0].text == _expected(lora_adapters, hf_tokenizer, "mlp4")


def test_bad_pins_are_refused_and_change_nothing(one_place_server):
    server = one_place_server
    before = _load(server)
    for body, code, needle in [
        ({"lora_name": "nope", "seconds": 3}, 404, "nope"),
        ({"lora_name": "qv8", "seconds": 0}, 400, "seconds"),
        ({"lora_name": "qv8", "seconds": 601}, 400, "seconds"),
        ({"lora_name": "qv8"}, 400, "seconds"),
    ]:
        got, text = post(server, "/v1/pin_lora_adapter", body)
        assert got == code and needle in text, (body, got, text)
    after = _load(server)
    assert (after["lora_adapters"], after["lora_room"]) == (before["lora_adapters"], before["lora_room"])
