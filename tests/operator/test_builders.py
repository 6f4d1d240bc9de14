"""Pure builders: spec -> RuntimeConfig and manifests, asserted exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from tokenfleet.operator.api import parse_cache_policy, parse_model_deployment
from tokenfleet.operator.builders import (
    OPERATOR_SET_FIELDS,
    POD_DEFAULT_FIELDS,
    build_config_map,
    build_deployment,
    build_runtime_config,
    build_service,
    config_hash,
    selector_string,
)
from tokenfleet.operator.runtime_fields import runtime_values
from tokenfleet.runtime.config import RuntimeConfig
from tokenfleet.runtime.errors import ConfigError

CPU = {"model": {"servedName": "smol"}, "engine": {"maxNumSeqs": 8, "maxWaiting": 10}}
GPU = {
    "model": {"source": "pvc://models/llama-8b", "quantization": "fp8", "dtype": "bfloat16"},
    "replicas": 2,
    "tensorParallelSize": 2,
    "resources": {"gpus": 2, "cpu": "8", "memory": "64Gi"},
}


def _runtime(spec: dict, cache: dict | None = None) -> tuple:
    md = parse_model_deployment(spec)
    cp = parse_cache_policy(cache) if cache is not None else None
    return md, build_runtime_config(md, cp)


def test_runtime_config_from_spec_and_cache_policy():
    _, cfg = _runtime(
        CPU,
        {
            "blockSize": 32,
            "prefixCaching": {"ttlSeconds": 30, "eviction": "s3fifo"},
            "cpuOffload": {"enabled": True, "sizeGiB": 4},
        },
    )
    assert cfg.model.model == "smollm2-135m-instruct" and cfg.model.name == "smol"
    assert cfg.model.device == "cpu"
    assert (cfg.scheduler.max_num_seqs, cfg.scheduler.max_waiting) == (8, 10)
    assert not cfg.scheduler.fair_share
    assert _runtime({**CPU, "engine": {"fairShare": True}})[1].scheduler.fair_share
    assert cfg.server.stream_interval == 1
    assert _runtime({**CPU, "engine": {"streamInterval": 4}})[1].server.stream_interval == 4
    assert (cfg.cache.block_size, cfg.cache.ttl_seconds, cfg.cache.eviction) == (32, 30, "s3fifo")
    assert cfg.cache.cpu_offload_gib == 4
    assert (cfg.server.host, cfg.server.port) == ("0.0.0.0", 8000)
    # What the pod reads back is what the operator meant.
    assert RuntimeConfig.model_validate(__import__("yaml").safe_load(cfg.dump_yaml())) == cfg


def test_context_policy_and_generation_defaults_reach_the_pod():
    _, cfg = _runtime(
        {"model": {"contextOverflow": "truncate", "generationConfig": "none", "defaultMaxTokens": 256}}
    )
    assert (cfg.model.context_overflow, cfg.model.generation_config) == ("truncate", "none")
    assert cfg.model.default_max_tokens == 256
    with pytest.raises(ConfigError, match="defaultMaxTokens"):
        parse_model_deployment({"model": {"defaultMaxTokens": 0}})
    with pytest.raises(ConfigError, match="contextOverflow"):
        parse_model_deployment({"model": {"contextOverflow": "drop-the-middle"}})


def test_without_cache_policy_the_runtime_defaults_apply():
    _, cfg = _runtime({})
    assert cfg.cache == RuntimeConfig().cache


def test_live_fields_keep_the_hash_restart_fields_change_it():
    _, base = _runtime(CPU, {"prefixCaching": {"ttlSeconds": 30}})
    _, live = _runtime(
        CPU, {"prefixCaching": {"ttlSeconds": 90, "eviction": "lfu"}, "pinnedPrefixes": ["sys"]}
    )
    _, restart = _runtime(CPU, {"blockSize": 32, "prefixCaching": {"ttlSeconds": 30}})
    assert config_hash(base) == config_hash(live)
    assert config_hash(base) != config_hash(restart)
    assert len(config_hash(base)) == 16
    # The stream interval is applied by the running pods too: no roll.
    engine = {**CPU["engine"], "streamInterval": 4}
    _, chunky = _runtime({**CPU, "engine": engine}, {"prefixCaching": {"ttlSeconds": 30}})
    assert chunky.server.stream_interval == 4 and config_hash(chunky) == config_hash(base)


def test_cpu_deployment_manifest():
    md, cfg = _runtime(CPU)
    dep = build_deployment("smol", md, cfg)
    assert dep["metadata"]["name"] == "smol"
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["selector"] == {
        "matchLabels": {"app.kubernetes.io/instance": "smol", "app.kubernetes.io/component": "runtime"}
    }
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["tokenfleet", "serve", "--config", "/etc/tokenfleet/runtime.yaml"]
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}, "limits": {"memory": "4Gi"}}
    assert c["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 300
    # A cold start is not lengthened by probe periods: Ready within about a second of serving.
    assert c["startupProbe"]["periodSeconds"] == 1 and c["readinessProbe"]["periodSeconds"] <= 2
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert pod["volumes"][0] == {"name": "config", "configMap": {"name": "smol-runtime"}}
    assert pod["terminationGracePeriodSeconds"] == 45  # preStop 10 s + drain 30 s + 5
    assert "initContainers" not in pod
    # Replicas spread over nodes where they can (a preference: never Pending for it), per revision.
    assert pod["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": dep["spec"]["selector"]["matchLabels"]},
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]
    # A lost node's pods are replaced after 30 s, not Kubernetes' default 300 s.
    assert pod["tolerations"] == [
        {
            "key": f"node.kubernetes.io/{taint}",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 30,
        }
        for taint in ("not-ready", "unreachable")
    ]
    annotations = dep["spec"]["template"]["metadata"]["annotations"]
    assert annotations["serving.tokenfleet.dev/config-hash"] == config_hash(cfg)


@pytest.mark.parametrize(("cpu", "threads"), [("2", "2"), ("500m", "1"), ("3.5", "3"), ("16", "16")])
def test_cpu_pods_size_torch_threads_by_their_cpu_request(cpu, threads):
    md, cfg = _runtime({**CPU, "resources": {"cpu": cpu}})
    (c,) = build_deployment("smol", md, cfg)["spec"]["template"]["spec"]["containers"]
    assert {"name": "OMP_NUM_THREADS", "value": threads} in c["env"]
    assert c["resources"]["requests"]["cpu"] == cpu


def test_gpu_pods_leave_torch_threads_alone():
    md, cfg = _runtime(GPU)
    (c,) = build_deployment("llama", md, cfg)["spec"]["template"]["spec"]["containers"]
    assert all(e["name"] != "OMP_NUM_THREADS" for e in c["env"])


def test_gpu_deployment_manifest():
    md, cfg = _runtime(GPU)
    assert cfg.model.model == "/models/models/llama-8b" and cfg.model.name == "llama-8b"
    assert (cfg.model.device, cfg.model.quantization) == ("cuda", "fp8")
    pod = build_deployment("llama", md, cfg)["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["resources"] == {
        "requests": {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"},
    }
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "volumes"
    ]
    assert {"name": "model", "mountPath": "/models/models", "readOnly": True} in c["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert pod["tolerations"][-1] == {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert [t["key"] for t in pod["tolerations"][:2]] == [
        "node.kubernetes.io/not-ready",
        "node.kubernetes.io/unreachable",
    ]
    assert c["startupProbe"]["failureThreshold"] * c["startupProbe"]["periodSeconds"] == 600


def test_hf_source_uses_an_init_container():
    md, cfg = _runtime({"model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct@v1"}})
    assert cfg.model.model == "/models/Qwen/Qwen2.5-0.5B-Instruct"  # the link the fetch points at its entry
    assert cfg.model.name == "Qwen/Qwen2.5-0.5B-Instruct"
    pod = build_deployment("qwen", md, cfg)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == [
        "tokenfleet", "fetch", "hf://Qwen/Qwen2.5-0.5B-Instruct@v1",
        "--cache-dir", "/var/cache/tokenfleet", "--link", "/models/Qwen/Qwen2.5-0.5B-Instruct",
        "--status-port", "8000",  # the download's progress on the pod's port, for status.loading
        "--work-dir", "deployments/$(POD_NAMESPACE)/qwen",  # made as the pods' user, for the subPath
    ]  # fmt: skip
    assert init["terminationMessagePolicy"] == "FallbackToLogsOnError"  # its reason reaches the status
    assert {"name": "model", "emptyDir": {}} in pod["volumes"]
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]  # no cache named: lost with the pod
    assert all(e["name"] != "HF_ENDPOINT" for e in init["env"])  # the hub client's default
    main = next(c for c in pod["containers"] if c["name"] == "runtime")
    # The link and the entry it points at are at the same paths in both containers, read-only in the server.
    for name, path in (("model", "/models"), ("model-cache", "/var/cache/tokenfleet")):
        assert {"name": name, "mountPath": path} in init["volumeMounts"]
        assert {"name": name, "mountPath": path, "readOnly": True} in main["volumeMounts"]
    # The server writes only its deployment's own directory of the cache (converted weights, compile
    # caches): a node cache is shared by every deployment on the node, of every namespace.
    work = {
        "name": "model-cache",
        "mountPath": "/var/cache/tokenfleet-work",
        "subPathExpr": "deployments/$(POD_NAMESPACE)/qwen",
    }
    assert work in main["volumeMounts"]
    assert cfg.model.weight_cache_dir == "/var/cache/tokenfleet-work"
    namespace = {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}
    assert namespace in main["env"] and namespace in init["env"]
    env = {e["name"]: e.get("value") for e in main["env"]}
    assert env["TRITON_CACHE_DIR"] == "/var/cache/tokenfleet-work/triton"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/var/cache/tokenfleet-work/inductor"
    assert {"name": "tmp", "mountPath": "/tmp"} in init["volumeMounts"]  # HF_HOME on a read-only root


def test_sources_without_a_cache_volume_convert_on_every_start():
    md, cfg = _runtime({"model": {"source": "smollm2-135m-instruct"}})
    assert cfg.model.weight_cache_dir is None  # nowhere shared to keep it: the pod's /tmp dies with it
    main = build_deployment("chat", md, cfg)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in main["env"]}
    assert env["TRITON_CACHE_DIR"] == "/tmp/triton" and "TORCHINDUCTOR_CACHE_DIR" not in env


def test_hf_source_with_a_token_and_a_cache_claim():
    model = {
        "source": "hf://meta-llama/Llama-3.2-1B@v2",
        "hfTokenSecret": {"name": "hf"},
        "cacheClaim": "model-cache",
        "hfEndpoint": "https://hf-mirror.internal.example",
    }
    md, cfg = _runtime({"model": model})
    assert cfg.model.model == "/models/meta-llama/Llama-3.2-1B"
    pod = build_deployment("llama", md, cfg)["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert token in init["env"]
    assert {"name": "HF_ENDPOINT", "value": "https://hf-mirror.internal.example"} in init["env"]
    assert all(e["name"] != "HF_TOKEN" for c in pod["containers"] for e in c.get("env", []))  # download only
    assert {"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in pod["volumes"]
    assert pod["securityContext"]["fsGroup"] == 1000  # the non-root download can write to the claim


def test_hf_source_with_the_node_cache():
    md, cfg = _runtime({"model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct", "nodeCache": True}})
    pod = build_deployment("qwen", md, cfg)["spec"]["template"]["spec"]
    cache = {
        "name": "model-cache",
        "hostPath": {"path": "/var/cache/tokenfleet", "type": "DirectoryOrCreate"},
    }
    assert cache in pod["volumes"]
    assert pod["initContainers"][0]["command"][2] == "hf://Qwen/Qwen2.5-0.5B-Instruct"  # revision: main
    # The node's directory is the administrator's (--node-cache-dir); inside the pod the path stays the same.
    pod = build_deployment("qwen", md, cfg, node_cache_dir="/mnt/nvme/models")["spec"]["template"]["spec"]
    assert {
        "name": "model-cache",
        "hostPath": {"path": "/mnt/nvme/models", "type": "DirectoryOrCreate"},
    } in pod["volumes"]
    assert {"name": "model-cache", "mountPath": "/var/cache/tokenfleet"} in pod["initContainers"][0][
        "volumeMounts"
    ]


def test_node_cache_and_a_cache_claim_together_are_refused():
    model = {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct", "nodeCache": True, "cacheClaim": "models"}
    with pytest.raises(ConfigError, match="one cache, not both"):
        parse_model_deployment({"model": model})


@pytest.mark.parametrize(
    "field",
    [
        {"hfTokenSecret": {"name": "hf"}},
        {"cacheClaim": "model-cache"},
        {"nodeCache": True},
        {"hfEndpoint": "https://hf-mirror.internal.example"},
    ],
)
def test_download_settings_on_a_source_that_is_not_downloaded_are_refused(field):
    with pytest.raises(ConfigError, match="only an hf:// source is downloaded"):
        parse_model_deployment({"model": {"source": "pvc://models/llama", **field}})


def test_hostpath_source_mounts_the_same_path():
    md, cfg = _runtime({"model": {"source": "file:///data/smol.gguf"}})
    assert (cfg.model.model, cfg.model.name) == ("/data/smol.gguf", "smol")
    pod = build_deployment("dev", md, cfg)["spec"]["template"]["spec"]
    assert {"name": "model", "hostPath": {"path": "/data/smol.gguf"}} in pod["volumes"]


def test_config_map_and_service():
    _, cfg = _runtime(CPU)
    cm = build_config_map("smol", cfg)
    assert cm["metadata"]["name"] == "smol-runtime"
    assert cm["data"] == {"runtime.yaml": cfg.dump_yaml()}
    svc = build_service("smol")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert svc["spec"]["selector"] == {
        "app.kubernetes.io/instance": "smol",
        "app.kubernetes.io/component": "runtime",
    }
    assert selector_string("smol") == "app.kubernetes.io/instance=smol,app.kubernetes.io/component=runtime"


@pytest.mark.parametrize("replicas", [0, 5])
def test_replicas_follow_the_spec(replicas):
    md, cfg = _runtime({**CPU, "replicas": replicas})
    assert build_deployment("smol", md, cfg)["spec"]["replicas"] == replicas


def _runtime_paths() -> set[str]:
    return {
        f"{section}.{name}"
        for section, info in RuntimeConfig.model_fields.items()
        for name in info.annotation.model_fields
    }


def test_every_runtime_field_is_copied_derived_or_left_to_the_pod():
    """A field added to RuntimeConfig must be placed: exposed by a CRD (runtime_field), set by the operator,
    or deliberately left at the runtime's default. Nothing falls through silently."""
    copied = set(runtime_values(parse_model_deployment({}))) | set(runtime_values(parse_cache_policy({})))
    assert not (copied & OPERATOR_SET_FIELDS) and not (copied & POD_DEFAULT_FIELDS)
    unplaced = _runtime_paths() - copied - OPERATOR_SET_FIELDS - POD_DEFAULT_FIELDS
    assert not unplaced, f"RuntimeConfig fields the operator does not know: {sorted(unplaced)}"


def test_crd_defaults_are_the_runtime_defaults():
    defaults = RuntimeConfig().model_dump()
    for spec in (parse_model_deployment({}), parse_cache_policy({})):
        for dotted, value in runtime_values(spec).items():
            section, name = dotted.split(".")
            assert value == defaults[section][name], dotted


def test_tensor_parallel_size_reaches_the_runtime_and_the_gpu_request():
    md, cfg = _runtime(GPU)
    assert cfg.parallel.tensor_parallel_size == 2
    limits = build_deployment("llama", md, cfg)["spec"]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ]
    assert limits["nvidia.com/gpu"] == "2"
    # Resharding needs new worker processes: a TP change rolls the pods.
    _, tp4 = _runtime({**GPU, "tensorParallelSize": 4, "resources": {**GPU["resources"], "gpus": 4}})
    assert tp4.parallel.tensor_parallel_size == 4 and config_hash(tp4) != config_hash(cfg)


def test_tensor_parallelism_on_cpu_pods():
    md, cfg = _runtime({"tensorParallelSize": 3})
    assert (cfg.model.device, cfg.parallel.tensor_parallel_size) == ("cpu", 3)
    pod = build_deployment("cpu-tp", md, cfg)["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["limits"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]


def test_the_gpu_example_shards_over_the_gpus_it_reserves():
    path = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "gpu-modeldeployment.yaml"
    md = parse_model_deployment(yaml.safe_load(path.read_text())["spec"])
    cfg = build_runtime_config(md, parse_cache_policy({}))
    gpus = build_deployment("llama-8b", md, cfg)["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert int(gpus["limits"]["nvidia.com/gpu"]) == cfg.parallel.tensor_parallel_size == 2
    assert cfg.model.device == "cuda"


LORA = {
    "model": {"servedName": "smol"},
    "adapters": [
        {"name": "sql", "source": "pvc://adapters/team-a/sql"},
        {"name": "chat-v2", "source": "pvc://adapters/team-b/chat"},
        {"name": "dev", "source": "file:///srv/lora/dev"},
    ],
    "lora": {"maxLoras": 2, "maxLoraRank": 32},
}


def test_adapters_reach_the_pods_config_and_volumes():
    md, cfg = _runtime(LORA)
    assert cfg.lora.enable and (cfg.lora.max_loras, cfg.lora.max_lora_rank) == (2, 32)
    assert cfg.lora.max_cpu_loras == 3  # unset: every listed adapter fits in host memory
    assert [(m.name, m.path) for m in cfg.lora.modules] == [
        ("sql", "/adapters/adapters/team-a/sql"),
        ("chat-v2", "/adapters/adapters/team-b/chat"),
        ("dev", "/srv/lora/dev"),
    ]
    pod = build_deployment("m", md, cfg)["spec"]["template"]["spec"]
    adapter_volumes = [v for v in pod["volumes"] if v["name"].startswith("adapters-")]
    # One read-only volume per claim, however many adapters it holds; a hostPath per file:// path.
    assert [v.get("persistentVolumeClaim") or v.get("hostPath") for v in adapter_volumes] == [
        {"claimName": "adapters", "readOnly": True},
        {"path": "/srv/lora/dev"},
    ]
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert [(mounts[v["name"]]["mountPath"], mounts[v["name"]]["readOnly"]) for v in adapter_volumes] == [
        ("/adapters/adapters", True),
        ("/srv/lora/dev", True),
    ]


def test_editing_adapters_on_a_mounted_claim_needs_no_rollout():
    md, cfg = _runtime(LORA)
    edited = {**LORA, "adapters": [*LORA["adapters"][1:], {"name": "sum", "source": "pvc://adapters/x/sum"}]}
    md2, cfg2 = _runtime(edited)
    assert [m.name for m in cfg2.lora.modules] == ["chat-v2", "dev", "sum"]
    assert config_hash(cfg2) == config_hash(cfg)  # lora.modules and the host limit apply live
    template = build_deployment("m", md, cfg)["spec"]["template"]["spec"]
    assert build_deployment("m", md2, cfg2)["spec"]["template"]["spec"] == template
    # The first adapter turns LoRA on (device slots, the adapter hooks): that one rolls the pods.
    _, plain = _runtime({"model": {"servedName": "smol"}})
    assert not plain.lora.enable and config_hash(plain) != config_hash(cfg)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"adapters": [{"name": "a", "source": "pvc://c/x"}, {"name": "a", "source": "pvc://c/y"}]},
            "unique",
        ),
        ({"adapters": [{"name": "a", "source": "s3://bucket/name"}]}, "source"),
        ({"adapters": [{"name": "a", "source": "hf://name"}]}, "source"),
        (
            {
                "adapters": [{"name": "a", "source": "pvc://c/x"}] * 1,
                "lora": {"maxCpuLoras": 1, "maxLoras": 2},
            },
            ">=",
        ),
    ],
)
def test_bad_adapter_lists_are_refused(spec, message):
    with pytest.raises((ValueError, ConfigError), match=message):
        parse_model_deployment(spec)


HUB_ENV = ("HF_HOME", "HF_HUB_DISABLE_TELEMETRY", "NO_COLOR", "HF_ENDPOINT", "HF_TOKEN")


def _serving_env(spec: dict) -> list[dict]:
    md, cfg = _runtime(spec)
    (container,) = build_deployment("m", md, cfg)["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "runtime"
    return container["env"]


def test_hf_adapters_are_downloaded_by_the_pods():
    model = {
        "source": "hf://Qwen/Qwen2.5-0.5B-Instruct",
        "hfEndpoint": "https://hf-mirror.internal.example",
        "hfTokenSecret": {"name": "model-token"},
    }
    spec = {
        "model": model,
        "adapters": [
            {"name": "sql", "source": "hf://team-a/sql-lora"},
            {"name": "chat", "source": "hf://team-b/chat.lora@0123456789abcdef0123456789abcdef01234567"},
            {"name": "local", "source": "pvc://adapters/team-a/local"},
        ],
    }
    md, cfg = _runtime(spec)
    # The runtime gets the hf:// sources as they are and downloads them itself.
    assert [(m.name, m.path) for m in cfg.lora.modules] == [
        ("sql", "hf://team-a/sql-lora"),
        ("chat", "hf://team-b/chat.lora@0123456789abcdef0123456789abcdef01234567"),
        ("local", "/adapters/adapters/team-a/local"),
    ]
    pod = build_deployment("m", md, cfg)["spec"]["template"]["spec"]
    adapter_volumes = [v for v in pod["volumes"] if v["name"].startswith("adapters-")]
    assert [v.get("persistentVolumeClaim") for v in adapter_volumes] == [
        {"claimName": "adapters", "readOnly": True}
    ]  # no volume for an hf:// adapter
    (main,) = pod["containers"]
    hub = [e for e in main["env"] if e["name"] in HUB_ENV]
    assert hub == [
        {"name": "HF_HOME", "value": "/tmp/hf"},
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": "NO_COLOR", "value": "1"},
        {"name": "HF_ENDPOINT", "value": "https://hf-mirror.internal.example"},  # the model's, by default
    ]  # and no HF_TOKEN: the model's token goes to its download alone
    init_token = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "model-token", "key": "token"}}}
    assert init_token in pod["initContainers"][0]["env"]


def test_hf_adapters_endpoint_and_token_of_their_own():
    lora = {
        "hfEndpoint": "https://adapters-mirror.example/hub",
        "hfTokenSecret": {"name": "adapter-token", "key": "hf"},
    }
    model = {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct", "hfEndpoint": "https://hf-mirror.internal.example"}
    spec = {"model": model, "adapters": [{"name": "sql", "source": "hf://team-a/sql-lora@v2"}], "lora": lora}
    env = {e["name"]: e for e in _serving_env(spec)}
    assert env["HF_ENDPOINT"] == {"name": "HF_ENDPOINT", "value": "https://adapters-mirror.example/hub"}
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "adapter-token", "key": "hf"}},
    }
    # Neither endpoint set: huggingface_hub's own default (huggingface.co), no HF_ENDPOINT.
    names = [e["name"] for e in _serving_env({"adapters": [{"name": "sql", "source": "hf://team-a/sql"}]})]
    assert "HF_HOME" in names and "HF_ENDPOINT" not in names and "HF_TOKEN" not in names
    # The lora settings are valid whatever the model's source (they are not the model's download).
    assert parse_model_deployment(
        {"model": {"source": "pvc://models/llama"}, "lora": lora}
    ).lora.hf_token_secret


def test_without_adapters_the_pods_get_no_hub_env():
    plain = {"model": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct", "hfEndpoint": "https://mirror.example"}}
    assert not [e for e in _serving_env(plain) if e["name"] in HUB_ENV]
    # Lora settings alone change nothing in the pods: no adapter, no LoRA.
    lora = {"hfEndpoint": "https://adapters.example", "hfTokenSecret": {"name": "adapter-token"}}
    md, cfg = _runtime(plain)
    md2, cfg2 = _runtime({**plain, "lora": lora})
    assert build_deployment("m", md2, cfg2) == build_deployment("m", md, cfg)


def test_adding_an_hf_adapter_beside_others_needs_no_rollout():
    md, cfg = _runtime(LORA)
    edited = {**LORA, "adapters": [*LORA["adapters"], {"name": "hub", "source": "hf://team-c/hub-lora@main"}]}
    md2, cfg2 = _runtime(edited)
    assert cfg2.lora.modules[-1].path == "hf://team-c/hub-lora@main"
    assert build_config_map("m", cfg2) != build_config_map("m", cfg)  # the pods reload it: live
    assert config_hash(cfg2) == config_hash(cfg)
    assert build_deployment("m", md2, cfg2) == build_deployment("m", md, cfg)
    # Its endpoint or token is a change of the serving container's env: that one rolls the pods.
    md3, cfg3 = _runtime({**edited, "lora": {**LORA["lora"], "hfEndpoint": "https://mirror.example"}})
    assert (
        build_deployment("m", md3, cfg3)["spec"]["template"]
        != build_deployment("m", md2, cfg2)["spec"]["template"]
    )


def test_more_adapters_than_a_pod_holds_are_loaded_on_demand():
    _, cfg = _runtime({**LORA, "lora": {"maxLoras": 1, "maxCpuLoras": 2}})
    assert cfg.lora.max_cpu_loras == 2 and len(cfg.lora.modules) == 3


def test_an_adapter_named_like_the_model_is_refused():
    md = parse_model_deployment(
        {"model": {"servedName": "smol"}, "adapters": [{"name": "smol", "source": "pvc://c/x"}]}
    )
    with pytest.raises(ConfigError, match="served name"):
        build_runtime_config(md, None)
