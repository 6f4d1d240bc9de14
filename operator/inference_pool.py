"""The InferencePool of a ModelDeployment (Gateway API Inference Extension, inference.networking.k8s.io/v1).

A gateway that implements the Inference Extension routes a model's traffic to an InferencePool: the pool
selects the model-server pods (the same labels the runtime Service selects) on their serving port and names
the endpoint picker the gateway asks which pod gets each request (it scrapes the pods' queue and KV-cache
metrics, see runtime/server/metrics.py). The operator writes one pool per ModelDeployment, named after it
and owned by it (garbage-collected with it), whenever the cluster serves the kind. Without the CRD it does
nothing else differently: it notes the absence once in its log and looks again after a resync period, so a
CRD installed later is picked up without a restart.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.operator.api import GROUP, ModelDeploymentSpec
from tokenfleet.operator.builders import RUNTIME_PORT, common_labels
from tokenfleet.operator.kube import INFERENCE_POOL_API


def endpoint_picker_name(name: str, spec: ModelDeploymentSpec) -> str:
    # `<pool>-epp` is the name the Inference Extension's endpoint-picker chart gives its Service.
    return spec.inference_pool.endpoint_picker.name or f"{name}-epp"


def pool_selector(name: str) -> dict[str, str]:
    """The pool's pods: every runtime pod of the ModelDeployment, in either serving mode (its label; an
    aggregated deployment's pods are also what Service `name` selects).

    Disaggregated, that is the pods of both roles (each labelled with its role), as the Inference
    Extension's prefill/decode design has it: a gateway sends an HTTPRoute rule to one pool and its endpoint
    picker chooses a request's endpoints from it. A picker that knows prefill/decode filters the pods by
    their role label (`serving.tokenfleet.dev/role`); any other picker still serves, every pod answering
    whole requests, with all of the deployment's capacity (a decode-only pool would leave the prefill pods
    idle; a pool per role would need two routes with nothing to choose between them). One selector for
    both modes also keeps the old mode's pods in the pool while a switch between them is under way.
    """
    return {f"{GROUP}/model-deployment": name, "app.kubernetes.io/component": "runtime"}


def build_inference_pool(name: str, spec: ModelDeploymentSpec) -> dict[str, Any]:
    picker = spec.inference_pool.endpoint_picker
    return {
        "apiVersion": INFERENCE_POOL_API,
        "kind": "InferencePool",
        "metadata": {"name": name, "labels": common_labels(name)},
        "spec": {
            "selector": {"matchLabels": pool_selector(name)},
            "targetPorts": [{"number": RUNTIME_PORT}],
            "endpointPickerRef": {
                "group": picker.group,
                "kind": picker.kind,
                "name": endpoint_picker_name(name, spec),
                "port": {"number": picker.port},
                "failureMode": picker.failure_mode,
            },
        },
    }


@dataclass(eq=False)
class PoolSupport:
    """Whether the cluster serves InferencePools, as the last write found out.

    Mutable on purpose, and the operator's only such state: a handler that races another at worst makes
    one extra request. After a "not served" answer the kind is tried again only every `recheck_seconds`,
    so a cluster without the CRD costs one failing request per period, not one per reconcile.
    """

    recheck_seconds: float
    clock: Callable[[], float] = time.monotonic
    served: bool | None = None  # None: not known yet
    _checked_at: float = field(default=float("-inf"))

    def worth_trying(self) -> bool:
        return self.served is not False or self.clock() - self._checked_at >= self.recheck_seconds

    def found(self, served: bool, logger: logging.Logger) -> None:
        if served != self.served:
            if served:
                logger.info(
                    "InferencePool (%s) is served: writing one per ModelDeployment", INFERENCE_POOL_API
                )
            else:
                logger.info(
                    "InferencePool CRD (%s) is not installed: no InferencePools are written; a gateway "
                    "cannot select the pods until it is (looked at again every %.0f s)",
                    INFERENCE_POOL_API,
                    self.recheck_seconds,
                )
        self.served = served
        self._checked_at = self.clock()
