"""The pod's endpoint access table and the deployment's internal key (server.internal_api_key_file).

Probes stay open; the OpenAI endpoints take a client key or the internal key; with an internal key set,
what only routers and pods call (KV events, KV transfer and holds, config, tokenizer) takes only it, and the
router's priority header is believed only from a caller holding it. A pod without an internal key behaves
as before.
"""

from __future__ import annotations

import hashlib

import pytest
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.errors import ConfigError
from tokenfleet.runtime.server.access import Access, access_of, access_table
from tokenfleet.runtime.server.auth import InternalKey

BODY = {"prompt": "abc", "max_tokens": 2}
CLIENT = {"Authorization": "Bearer client-key"}
INTERNAL = {"Authorization": "Bearer internal-key"}


@pytest.mark.parametrize(
    ("path", "with_internal", "without"),
    [
        ("/health", Access.OPEN, Access.OPEN),
        ("/ready", Access.OPEN, Access.OPEN),
        ("/load", Access.OPEN, Access.OPEN),
        ("/metrics", Access.OPEN, Access.OPEN),
        ("/version", Access.OPEN, Access.OPEN),
        ("/v1/models", Access.CLIENT, Access.CLIENT),
        ("/v1/completions", Access.CLIENT, Access.CLIENT),
        ("/v1/chat/completions", Access.CLIENT, Access.CLIENT),
        ("/v1/kv-events", Access.INTERNAL, Access.CLIENT),
        ("/v1/kv/fetch", Access.INTERNAL, Access.CLIENT),
        ("/v1/kv/holds/abc123", Access.INTERNAL, Access.CLIENT),
        ("/v1/config", Access.INTERNAL, Access.CLIENT),
        ("/v1/tokenizer", Access.INTERNAL, Access.CLIENT),
        ("/v1/unknown", Access.CLIENT, Access.CLIENT),  # 401 before 404: no probing of routes
        ("/nothing-here", Access.OPEN, Access.OPEN),
    ],
)
def test_access_table(path, with_internal, without):
    assert access_of(path, internal_key_set=True) is with_internal
    assert access_of(path, internal_key_set=False) is without


def test_access_table_report_says_what_and_why():
    table = access_table(internal_key_set=True, client_keys_set=True)
    assert table["/v1/kv-events"]["needs"] == "internal_key"
    assert "internal_api_key_file" in table["/v1/kv-events"]["why"]
    assert table["/v1/completions"]["needs"] == "client_or_internal_key"
    assert table["/health"]["needs"] == "open"
    assert access_table(False, False)["/v1/kv-events"]["needs"] == "none"


def test_internal_key_rotation_and_overlap(tmp_path):
    path = tmp_path / "internal"
    path.write_text("old\n")
    now = [0.0]
    key = InternalKey(str(path), recheck_seconds=1.0, clock=lambda: now[0])
    assert key.check("Bearer old") and not key.check("Bearer new") and not key.check(None)
    path.write_text("new\nold\n")  # the rotation overlaps: both accepted for a while
    now[0] = 2.0
    assert key.check("Bearer new") and key.check("Bearer old")
    path.write_text("new\n")
    now[0] = 4.0
    assert key.check("Bearer new") and not key.check("Bearer old")
    assert not InternalKey(None).check("Bearer new")  # unset: it opens nothing


@pytest.fixture
def keyed_config(tmp_path) -> RuntimeConfig:
    path = tmp_path / "internal-key"
    path.write_text("internal-key\n")
    return RuntimeConfig.model_validate(
        {"server": {"api_keys": ["client-key"], "internal_api_key_file": str(path)}}
    )


async def test_internal_endpoints_need_the_internal_key(make_client, fake_engine, keyed_config):
    client = await make_client(fake_engine, keyed_config)
    for probe in ("/health", "/ready", "/metrics", "/version"):
        assert (await client.get(probe)).status == 200
    for headers, want in ((CLIENT, 200), (INTERNAL, 200), ({}, 401)):
        assert (await client.post("/v1/completions", json=BODY, headers=headers)).status == want
        assert (await client.get("/v1/models", headers=headers)).status == want
    for path in ("/v1/kv-events", "/v1/config", "/v1/tokenizer"):
        refused = await client.get(path, headers=CLIENT)
        assert refused.status == 401, path
        error = (await refused.json())["error"]
        assert error["code"] == "internal_key_required" and "internal_api_key_file" in error["message"]
        assert (await client.get(path, headers=INTERNAL)).status != 401, path
    assert (await client.delete("/v1/kv/holds/h1", headers=CLIENT)).status == 401
    assert (await client.post("/v1/kv/fetch", json={}, headers=CLIENT)).status == 401
    config = await (await client.get("/v1/config", headers=INTERNAL)).json()
    assert config["effective"]["server"]["api_keys"] == ["<redacted>"]


async def test_priority_header_is_trusted_only_from_the_internal_key(make_client, fake_engine, keyed_config):
    client = await make_client(fake_engine, keyed_config)
    for headers in (CLIENT, INTERNAL):
        resp = await client.post(
            "/v1/completions", json=BODY, headers={**headers, "x-tokenfleet-priority": "-7"}
        )
        assert resp.status == 200
    assert list(fake_engine.priorities.values()) == [0, -7]


async def test_tenant_header_is_trusted_only_from_the_internal_key(make_client, fake_engine, keyed_config):
    client = await make_client(fake_engine, keyed_config)
    for headers in (CLIENT, INTERNAL, CLIENT, INTERNAL):
        resp = await client.post(
            "/v1/completions", json=BODY, headers={**headers, "x-tokenfleet-tenant": "acme"}
        )
        assert resp.status == 200
    for headers in (CLIENT, INTERNAL):
        assert (await client.post("/v1/completions", json=BODY, headers=headers)).status == 200
    client_digest = hashlib.blake2b(b"client-key", digest_size=16).hexdigest()
    # A client key cannot pose as another tenant: it counts as itself, by its digest (never the raw key);
    # the internal key is a router's, not a tenant's: a router naming no tenant sends an anonymous request.
    assert list(fake_engine.tenants.values()) == [
        client_digest,
        "acme",
        client_digest,
        "acme",
        client_digest,
        None,
    ]


async def test_without_client_keys_the_tenant_is_the_header_or_anonymous(make_client, fake_engine):
    client = await make_client(fake_engine)
    for headers in ({"x-tokenfleet-tenant": "acme"}, {}):
        assert (await client.post("/v1/completions", json=BODY, headers=headers)).status == 200
    assert list(fake_engine.tenants.values()) == ["acme", None]


async def test_without_an_internal_key_the_pod_behaves_as_before(make_client, fake_engine):
    client = await make_client(
        fake_engine, RuntimeConfig.model_validate({"server": {"api_keys": ["client-key"]}})
    )
    assert (await client.get("/v1/config", headers=CLIENT)).status == 200
    assert (await client.get("/v1/config")).status == 401
    resp = await client.post("/v1/completions", json=BODY, headers={**CLIENT, "x-tokenfleet-priority": "3"})
    assert resp.status == 200
    assert list(fake_engine.priorities.values()) == [3]


async def test_an_internal_key_set_live_guards_the_internal_endpoints_at_once(
    make_client, fake_engine, tmp_path
):
    from tokenfleet.runtime.server.live_config import on_change_for
    from tokenfleet.runtime.server.state import STATE_KEY

    old = RuntimeConfig.model_validate({"server": {"api_keys": ["client-key"]}})
    client = await make_client(None, old)  # /v1/config needs no engine; a reload then touches only keys
    assert (await client.get("/v1/config", headers=CLIENT)).status == 200
    (tmp_path / "k").write_text("internal-key\n")
    new = RuntimeConfig.model_validate(
        {"server": {"api_keys": ["client-key"], "internal_api_key_file": str(tmp_path / "k")}}
    )
    await on_change_for(client.app[STATE_KEY])(old, new)
    assert (await client.get("/v1/config", headers=CLIENT)).status == 401
    assert (await client.get("/v1/config", headers=INTERNAL)).status == 200
    missing = new.model_copy(
        update={"server": new.server.model_copy(update={"internal_api_key_file": "/nope"})}
    )
    with pytest.raises(ConfigError, match="internal_api_key_file"):
        await on_change_for(client.app[STATE_KEY])(new, missing)  # refused: the last good key stays
    assert (await client.get("/v1/config", headers=INTERNAL)).status == 200
