"""What the router sends each role of a disaggregated model (the flow itself: test_disaggregation_real_pods)."""

from __future__ import annotations

from tokenfleet.runtime.openai import kv_transfer as wire
from tokenfleet.runtime.router.config import Backend, Discovery
from tokenfleet.runtime.router.disaggregation import decode_payload, prefill_payload, role_targets
from tokenfleet.runtime.router.endpoints import EndpointSet
from tokenfleet.runtime.router.model_routes import RouteTarget

BACKENDS = [
    Backend(name="p", model="m", url="http://p:8000", role="prefill"),
    Backend(name="d", model="m", url="http://d:8000", role="decode"),
    Backend(name="plain", model="m", url="http://x:8000"),
]


def test_targets_narrow_to_a_role_and_drop_targets_without_it():
    targets = [RouteTarget("m", ("p", "d", "plain"), False), RouteTarget("other", ("plain",), True)]
    assert role_targets(BACKENDS, targets, "prefill") == (RouteTarget("m", ("p",), False),)
    assert role_targets(BACKENDS, targets, "decode") == (RouteTarget("m", ("d",), False),)
    assert role_targets(BACKENDS, [RouteTarget("other", ("plain",), False)], "decode") == ()


def test_a_backend_of_both_roles_is_narrowed_by_its_endpoints_labels():
    es = EndpointSet(Discovery())
    es.sync(BACKENDS[2], {"http://10.0.0.1:8000": "prefill", "http://10.0.0.2:8000": "decode"})
    targets = [RouteTarget("m", ("plain",), False)]
    endpoints = es.by_id.values()
    assert role_targets(BACKENDS, targets, "prefill", endpoints) == (
        RouteTarget("m", ("plain#prefill",), False),
    )
    [decode] = role_targets(BACKENDS, targets, "decode", endpoints)
    assert [e.url for e in es.of_backends(decode.backends)] == ["http://10.0.0.2:8000"]
    # Unlabelled endpoints: no role anywhere, the model is not disaggregated.
    es.sync(BACKENDS[2], ["http://10.0.0.1:8000"])
    assert role_targets(BACKENDS, targets, "prefill", es.by_id.values()) == ()


def test_the_prefill_pod_gets_one_token_unstreamed_and_a_bounded_hold():
    body = {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}, "n": 2,
            "max_completion_tokens": 50, "temperature": 0.7}  # fmt: skip
    pre = prefill_payload(body)
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert "stream" not in pre and "stream_options" not in pre and "n" not in pre
    assert pre["temperature"] == 0.7
    params = wire.PrefillParams.model_validate(pre[wire.FIELD])
    assert params.do_remote_decode and 0 < params.hold_seconds <= wire.MAX_HOLD_SECONDS
    assert body["stream"] is True  # the client's request is not changed


def test_the_decode_pod_gets_the_clients_request_and_where_the_kv_is():
    done = wire.PrefillDone(
        remote_url="http://10.0.0.5:8000", hold_id="h", block_hashes=["ab", "cd"], block_size=16
    )
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 30}
    dec = decode_payload(body, done)
    assert {k: v for k, v in dec.items() if k != wire.FIELD} == body
    params = wire.DecodeParams.model_validate(dec[wire.FIELD])
    assert (params.remote_url, params.hold_id, params.block_hashes) == (
        "http://10.0.0.5:8000",
        "h",
        ["ab", "cd"],
    )
