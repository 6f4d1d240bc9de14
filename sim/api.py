"""The Python API: `simulate(config) -> results dict` (what `tokenfleet simulate run` prints and saves).

from tokenfleet.sim.api import simulate
from tokenfleet.sim.config import parse_config
results = simulate(parse_config({"model": "8b", "fleet": {"gpu": "h100", "replicas": 4},
                                 "workload": {"rate": 20, "duration_s": 120}}))
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from tokenfleet.sim.config import SimConfig
from tokenfleet.sim.cost_model import CostModel, LinearCost, RooflineCost
from tokenfleet.sim.errors import SimInputError
from tokenfleet.sim.hardware import gpu_profile
from tokenfleet.sim.model_profile import ModelProfile, model_profile
from tokenfleet.sim.simulator import Simulation
from tokenfleet.sim.trace import TraceWorkload
from tokenfleet.sim.workload import Workload

DEFAULT_CPU_PROFILE = Path.home() / ".cache" / "tokenfleet" / "sim" / "cpu_profile.json"


def build_model(config: SimConfig) -> ModelProfile:
    model = model_profile(config.model)
    if config.fleet.gpu == "cpu":
        return model
    return model.with_precision(config.fleet.weights, config.fleet.kv_cache)


def build_cost(config: SimConfig, model: ModelProfile) -> CostModel:
    fleet = config.fleet
    if fleet.gpu == "cpu":
        path = fleet.cpu_profile or DEFAULT_CPU_PROFILE
        if not Path(path).is_file():
            raise SimInputError(
                "fleet.cpu_profile", f"{path} does not exist: run `tokenfleet simulate calibrate` first"
            )
        base = LinearCost.load(Path(path), model)
        return dataclasses.replace(base, kv_cache_bytes=fleet.cpu_kv_cache_gib * 2**30)
    return RooflineCost(gpu_profile(fleet.gpu, "fleet.gpu"), model, fleet.tp)


def build_workload(config: SimConfig):
    if config.trace is not None:
        return TraceWorkload(config.trace, config.workload.seed)
    return Workload(config.workload)


def simulate(config: SimConfig, cost: CostModel | None = None) -> dict:
    model = build_model(config)
    cost = cost or build_cost(config, model)
    if cost.num_kv_blocks(config.cache.block_size) < 1:
        raise SimInputError(
            "fleet",
            f"{model.name} ({model.weight_bytes / 1e9:.0f} GB of weights) leaves no KV cache on {cost.name}",
        )
    max_model_len = min(
        model.max_model_len, cost.num_kv_blocks(config.cache.block_size) * config.cache.block_size
    )
    sim = Simulation(
        config, build_workload(config), cost, model.name, max(max_model_len, 2), model.kv_bytes_per_token
    )
    return sim.run()
