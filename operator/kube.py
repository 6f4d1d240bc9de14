"""The few Kubernetes API calls the operator makes, over the `kubernetes` client's ApiClient.

Children are written with server-side apply (`application/apply-patch+yaml`, one field manager, forced):
create-or-patch in one request, idempotent (an apply that changes nothing does not write, so a restarted
operator causes no churn), and it leaves fields that others own alone (an HPA's replicas, a mesh's
injected annotations). Status is merge-patched on the `/status` subresource and only when it changed.

What the operator needs to know about its *other* custom resources comes from kopf's watch-fed indexes,
never from listing them (reconcile.py); Pods are listed by label only to explain a stuck rollout.
tests/operator/test_reconcile.py runs the reconcile logic over an in-memory implementation of this class.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kubernetes.client import ApiClient
from kubernetes.client.exceptions import ApiException
from tokenfleet.operator.api import GROUP, VERSION

FIELD_MANAGER = "tokenfleet-operator"
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
# Seconds per API request: a hung connection must fail the handler (kopf retries it), not block a worker.
REQUEST_TIMEOUT = 30


@dataclass(frozen=True, slots=True)
class Kind:
    api_version: str
    plural: str

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        prefix = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        path = f"{prefix}/namespaces/{namespace}/{self.plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path


KINDS: dict[str, Kind] = {
    "ConfigMap": Kind("v1", "configmaps"),
    "Pod": Kind("v1", "pods"),
    "Secret": Kind("v1", "secrets"),
    "Service": Kind("v1", "services"),
    "ServiceAccount": Kind("v1", "serviceaccounts"),
    "Deployment": Kind("apps/v1", "deployments"),
    "NetworkPolicy": Kind("networking.k8s.io/v1", "networkpolicies"),
    "PodDisruptionBudget": Kind("policy/v1", "poddisruptionbudgets"),
    "RoleBinding": Kind("rbac.authorization.k8s.io/v1", "rolebindings"),
    "ModelDeployment": Kind(f"{GROUP}/{VERSION}", "modeldeployments"),
    "CachePolicy": Kind(f"{GROUP}/{VERSION}", "cachepolicies"),
    "RoutingPolicy": Kind(f"{GROUP}/{VERSION}", "routingpolicies"),
    # Gateway API Inference Extension; served only where its CRD is installed.
    "InferencePool": Kind(INFERENCE_POOL_API, "inferencepools"),
}


class NotServed(Exception):
    """The API server does not serve this kind: its CustomResourceDefinition is not installed."""

    def __init__(self, kind: str):
        super().__init__(f"{kind} ({KINDS[kind].api_version}) is not served by this cluster")
        self.kind = kind


class NamespaceTerminating(Exception):
    """A create refused because its namespace is being deleted: nothing to reconcile there any more."""


def _namespace_terminating(body: str) -> bool:
    # The NamespaceLifecycle admission plugin's refusal: 403 with a cause of reason NamespaceTerminating
    # (an authorization failure is a 403 too, but never has that cause).
    try:
        causes = (json.loads(body).get("details") or {}).get("causes") or []
    except ValueError:
        return False
    return any(cause.get("reason") == "NamespaceTerminating" for cause in causes)


class Kube:
    """Thin, synchronous (kopf runs sync handlers in its thread pool) wrapper over ApiClient.call_api."""

    def __init__(self, api: ApiClient):
        self.api = api

    def _call(
        self, method: str, path: str, body: Any = None, content_type: str | None = None, **query: Any
    ) -> Any:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        method, url, headers, body, _ = self.api.param_serialize(
            method,
            path,
            query_params=[(k, v) for k, v in query.items() if v is not None],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(
            method, url, header_params=headers, body=body, _request_timeout=REQUEST_TIMEOUT
        )
        data = response.read()
        text = data.decode() if data else ""
        if not 200 <= response.status <= 299:
            if response.status == 403 and _namespace_terminating(text):
                raise NamespaceTerminating(path)
            raise ApiException.from_response(http_resp=response, body=text, data=None)
        return json.loads(text) if text else None

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._call("GET", KINDS[kind].path(namespace, name))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        return self._call("GET", KINDS[kind].path(namespace), labelSelector=label_selector)["items"]

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply `obj` (which names its namespace); returns the object as stored.

        Raises NotServed when the kind is unknown to the server: apply creates missing objects, and the
        namespace is the live parent's, so a 404 can only mean the resource type itself is missing.
        """
        meta = obj["metadata"]
        path = KINDS[obj["kind"]].path(meta["namespace"], meta["name"])
        try:
            return self._call(
                "PATCH",
                path,
                body=json.dumps(obj),
                content_type="application/apply-patch+yaml",  # JSON is valid YAML
                fieldManager=FIELD_MANAGER,
                force="true",
            )
        except ApiException as e:
            if e.status == 404:
                raise NotServed(obj["kind"]) from e
            raise

    def create_if_absent(self, obj: dict[str, Any]) -> bool:
        """Create `obj` unless an object of its name exists (then nothing is written): False when it did.

        For what must be made once and never overwritten (the internal key): a plain POST, so the
        operator neither reads nor rewrites what is stored.
        """
        meta = obj["metadata"]
        try:
            self._call(
                "POST",
                KINDS[obj["kind"]].path(meta["namespace"]),
                body=obj,
                content_type="application/json",
                fieldManager=FIELD_MANAGER,
            )
        except ApiException as e:
            if e.status == 409:
                return False
            raise
        return True

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete one object (its dependents go by garbage collection); False when there was none."""
        try:
            self._call("DELETE", KINDS[kind].path(namespace, name), propagationPolicy="Background")
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return True

    def patch_status(self, kind: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._call(
            "PATCH",
            KINDS[kind].path(namespace, name, "status"),
            body={"status": status},
            content_type="application/merge-patch+json",
        )

    def patch(self, kind: str, namespace: str, name: str, ops: list[dict[str, Any]]) -> None:
        """A JSON patch (RFC 6902) of the object itself: its `test` ops make it conditional, so a write
        decided from an older view fails (422) rather than undo a change made since (the autoscaler sets a
        disaggregated role's replicas, a spec field without a scale subresource of its own)."""
        self._call(
            "PATCH",
            KINDS[kind].path(namespace, name),
            body=ops,
            content_type="application/json-patch+json",
        )

    def annotate(self, kind: str, namespace: str, name: str, annotations: dict[str, str]) -> None:
        """Merge `annotations` into the object's (a merge patch of metadata.annotations only)."""
        self._call(
            "PATCH",
            KINDS[kind].path(namespace, name),
            body={"metadata": {"annotations": annotations}},
            content_type="application/merge-patch+json",
        )

    def scale(self, kind: str, namespace: str, name: str, replicas: int) -> None:
        """Set the replica count through the `/scale` subresource, as an HPA does (the autoscaler)."""
        self._call(
            "PATCH",
            KINDS[kind].path(namespace, name, "scale"),
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )
