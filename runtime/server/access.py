"""Who may call which pod endpoint: one table, a pure function from route to access class.

- OPEN: probes and figures a kubelet or a router reads without credentials (/health, /ready, /load,
  /metrics, /version). Nothing there is secret; /load names the tokenizer's digest and this table.
- CLIENT: the OpenAI endpoints (and any other /v1 path). A client key (`server.api_keys`,
  `server.api_key_file`) or the deployment's internal key opens them; with no client key configured they
  are open, as they always were.
- INTERNAL: what only routers and the other role's pods call — KV events, KV fetch and holds, /v1/config,
  /v1/tokenizer, sleep mode's /sleep, /wake_up, /is_sleeping and the LoRA adapter loads and unloads
  (vLLM's admin endpoints; here the router and the operator drive them: a tenant must not be able to put
  a pod to sleep or load files from its disk). With `server.internal_api_key_file` set only the internal key opens them: a client key
  must not let a tenant read the fleet's cache contents, pin KV or download the config. Without an
  internal key they fall back to CLIENT, so a pod configured as before keeps working as before.
"""

from __future__ import annotations

from enum import Enum

from tokenfleet.runtime.openai import kv_transfer as kv_wire
from tokenfleet.runtime.openai.tokenizer_wire import TOKENIZER_PATH

# vLLM's runtime LoRA endpoints: they load files from the pod's disk (server/lora_endpoints.py).
LORA_ADMIN_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/pin_lora_adapter"})


class Access(Enum):
    OPEN = "open"
    CLIENT = "client_or_internal_key"
    INTERNAL = "internal_key"


OPEN_PATHS = frozenset({"/health", "/ready", "/load", "/metrics", "/version"})
SLEEP_PATHS = frozenset({"/sleep", "/wake_up", "/is_sleeping"})  # vLLM's paths: outside /v1
INTERNAL_PATHS = frozenset(
    {"/v1/kv-events", kv_wire.FETCH_PATH, "/v1/config", TOKENIZER_PATH, *SLEEP_PATHS, *LORA_ADMIN_PATHS}
)
INTERNAL_PREFIXES = (kv_wire.HOLDS_PATH + "/",)

WHY = {
    Access.OPEN: "probes and load figures: kubelets and routers read them without credentials",
    Access.CLIENT: "the OpenAI API: a client key, or the internal key a router proxies with",
    Access.INTERNAL: "router and pod-to-pod traffic (cache contents, KV transfer, config, tokenizer, "
    "sleep mode, LoRA adapter loads): only the deployment's internal key (server.internal_api_key_file)",
}


def access_of(path: str, internal_key_set: bool) -> Access:
    """The access class of a request path on a pod with (or without) an internal key configured."""
    if path in OPEN_PATHS or (not path.startswith("/v1/") and path not in SLEEP_PATHS):
        return Access.OPEN  # unknown non-/v1 paths answer 404 without asking for a key
    internal = path in INTERNAL_PATHS or path.startswith(INTERNAL_PREFIXES)
    return Access.INTERNAL if internal and internal_key_set else Access.CLIENT


def access_table(internal_key_set: bool, client_keys_set: bool) -> dict[str, dict[str, str]]:
    """What /load reports: per endpoint, the key it needs now and why (for whoever debugs a 401)."""
    paths = [
        *sorted(OPEN_PATHS),
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        *sorted(INTERNAL_PATHS),
        kv_wire.HOLDS_PATH + "/{hold_id}",
    ]
    table = {}
    for path in paths:
        access = access_of(path, internal_key_set)
        needs = access.value
        if access is Access.CLIENT and not client_keys_set:
            needs = "none" if not internal_key_set else "none (no client key configured)"
        table[path] = {"needs": needs, "why": WHY[access]}
    return table
