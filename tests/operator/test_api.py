"""The CRD models: defaults, camelCase wire names, and the errors an invalid spec produces."""

from __future__ import annotations

import re

import pytest
from tokenfleet.operator.api import (
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
