"""The CRD models: defaults, camelCase wire names, and the errors an invalid spec produces."""

from __future__ import annotations

import re

import pytest
from tokenfleet.operator.api import (
    ADAPTER_SOURCE_PATTERN,
    SOURCE_PATTERN,
    parse_cache_policy,
    parse_model_deployment,
    parse_routing_policy,
    source_kind,
)
from tokenfleet.runtime.errors import ConfigError


def test_empty_spec_gets_cpu_defaults():
    spec = parse_model_deployment({})
    assert spec.model.source == "smollm2-135m-instruct"
    assert (spec.replicas, spec.resources.gpus, spec.tensor_parallel_size) == (1, 0, 1)
    assert spec.cache_policy_ref is None


def test_camel_case_wire_names():
    spec = parse_model_deployment(
        {
            "tensorParallelSize": 2,
            "resources": {"gpus": 4},
            "engine": {"maxNumSeqs": 8},
            "cachePolicyRef": "c",
        }
    )
    assert (spec.tensor_parallel_size, spec.engine.max_num_seqs, spec.cache_policy_ref) == (2, 8, "c")
    cp = parse_cache_policy({"cpuKVCacheGiB": 2.5, "cpuOffload": {"enabled": True, "sizeGiB": 8}})
    assert (cp.cpu_kv_cache_gib, cp.cpu_offload.size_gib) == (2.5, 8)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"tensorParallelSize": 2, "resources": {"gpus": 3}},
            "tensorParallelSize 2 must divide resources.gpus",
        ),
        ({"tensorParallelSize": 4, "resources": {"gpus": 6}}, "tensorParallelSize 4 must divide"),
        ({"model": {"quantization": "fp8"}}, "fp8 needs GPUs"),
        ({"engine": {"speculative": {"method": "draft"}}}, "needs engine.speculative.draftModel"),
        ({"replicas": -1}, "replicas: Input should be greater than or equal to 0"),
        ({"model": {"source": "ftp://host/x"}}, "model.source: String should match pattern"),
        ({"cachePolicyRef": "Not_A_Name"}, "cachePolicyRef: String should match pattern"),
        ({"replicaz": 2}, "replicaz: Extra inputs are not permitted"),
    ],
)
def test_invalid_model_deployment_names_the_field(spec, message):
    with pytest.raises(ConfigError) as err:
        parse_model_deployment(spec)
    assert message in str(err.value)
    assert str(err.value).startswith("invalid ModelDeployment spec: ")


def test_invalid_policies():
    with pytest.raises(ConfigError, match="blockSize: Input should be 8, 16, 32, 64 or 128"):
        parse_cache_policy({"blockSize": 12})
    with pytest.raises(ConfigError, match=re.escape("cpuOffload.enabled needs cpuOffload.sizeGiB > 0")):
        parse_cache_policy({"cpuOffload": {"enabled": True}})
    with pytest.raises(ConfigError, match="strategy: Input should be"):
        parse_routing_policy({"strategy": "random"})


@pytest.mark.parametrize(
    ("source", "kind"),
    [
        ("smollm2-135m-instruct", "builtin"),
        ("pvc://models/llama/model.gguf", "pvc"),
        ("file:///data/models/x.gguf", "hostpath"),
        ("hf://meta-llama/Llama-3.1-8B-Instruct@main", "hf"),
    ],
)
def test_source_kinds(source, kind):
    assert source_kind(source) == kind


def test_source_kind_rejects_unknown_scheme():
    with pytest.raises(ConfigError, match="not a built-in name"):
        source_kind("s3://bucket/model")


def test_tensor_parallelism_on_cpu_needs_no_gpus():
    """gloo workers on CPU: a CPU replica may be sharded too (resources.gpus 0)."""
    spec = parse_model_deployment({"tensorParallelSize": 3})
    assert (spec.tensor_parallel_size, spec.resources.gpus) == (3, 0)


HF_SOURCES = [
    "hf://org/name",
    "hf://meta-llama/Llama-3.2-1B@v2",
    "hf://org/name.v1_a-b@0123456789abcdef0123456789abcdef01234567",
    "hf://org/name@refs/pr/1",
    "hf://org",
    "hf://org/",
    "hf:///name",
    "hf://org/name/extra",
    "hf://org/name@",
    "hf://org/na me",
    "hf://org/name@rev ision",
    "hf://org/name@rev\n",
    "hf://org/n@me",
    "hf://ORG/Name@Main",
]


@pytest.mark.parametrize("source", HF_SOURCES)
def test_adapters_take_the_models_hf_grammar(source):
    """An adapter's hf:// source is valid exactly when a model's is (one grammar, shared)."""
    as_model = re.fullmatch(SOURCE_PATTERN.removeprefix("^").removesuffix("$"), source) is not None
    as_adapter = re.fullmatch(ADAPTER_SOURCE_PATTERN.removeprefix("^").removesuffix("$"), source) is not None
    assert as_adapter == as_model


@pytest.mark.parametrize("source", ["hf://org/name", "hf://org/name@main", "hf://org/name@refs/pr/1"])
def test_hf_adapter_sources_are_accepted(source):
    spec = parse_model_deployment({"adapters": [{"name": "a", "source": source}]})
    assert spec.adapters[0].source == source


@pytest.mark.parametrize(
    "source", ["hf://org", "hf://org/name/extra", "hf://org/name@", "hf://org/na me", "hf:///name", "hf://"]
)
def test_bad_hf_adapter_sources_are_refused(source):
    with pytest.raises(ConfigError, match=r"adapters\.0\.source: String should match pattern"):
        parse_model_deployment({"adapters": [{"name": "a", "source": source}]})


def test_lora_hub_settings_are_camel_case_and_need_no_hf_model():
    spec = parse_model_deployment(
        {
            "model": {"source": "pvc://models/llama"},
            "lora": {"hfEndpoint": "https://mirror.example", "hfTokenSecret": {"name": "adapters-token"}},
        }
    )
    assert spec.lora.hf_endpoint == "https://mirror.example"
    assert (spec.lora.hf_token_secret.name, spec.lora.hf_token_secret.key) == ("adapters-token", "token")
    with pytest.raises(ConfigError, match=r"lora\.hfEndpoint: String should match pattern"):
        parse_model_deployment({"lora": {"hfEndpoint": "ftp://mirror.example"}})


def test_an_adapters_min_copies_cannot_exceed_its_max():
    spec = parse_model_deployment(
        {"adapters": [{"name": "a", "source": "pvc://c/a", "minCopies": 2, "maxCopies": 3}]}
    )
    assert (spec.adapters[0].min_copies, spec.adapters[0].max_copies) == (2, 3)
    with pytest.raises(ConfigError, match=r"minCopies \(4\) is more than maxCopies \(3\)"):
        parse_model_deployment(
            {"adapters": [{"name": "a", "source": "pvc://c/a", "minCopies": 4, "maxCopies": 3}]}
        )
    with pytest.raises(ConfigError, match=r"maxCopies: Input should be greater than or equal to 1"):
        parse_model_deployment({"adapters": [{"name": "a", "source": "pvc://c/a", "maxCopies": 0}]})
