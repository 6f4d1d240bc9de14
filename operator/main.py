"""`tokenfleet operator`: run the kopf operator with tokenfleet's handlers.

Credentials come from one place for both clients the operator uses (kopf's watcher and the `kubernetes`
client the handlers write with): `--kubeconfig` if given, else the in-cluster ServiceAccount, else the
default kubeconfig. The operator never imports torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import kopf
from kubernetes import client, config
from tokenfleet.operator.api import DEFAULT_IMAGE, NODE_CACHE_DIR
from tokenfleet.operator.handlers import register
from tokenfleet.operator.kube import Kube
from tokenfleet.operator.reconcile import OperatorContext

DEFAULT_OPERATOR_NAMESPACE = "tokenfleet-system"  # manifests/namespace.yaml
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tokenfleet operator", description="Run the tokenfleet Kubernetes operator."
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--context", help="kubeconfig context to use")
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; glob patterns allowed); default: every namespace",
    )
    p.add_argument("--image", default=DEFAULT_IMAGE, help="image for router pods (default: %(default)s)")
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=60.0,
        help="how often every object is re-reconciled to correct drift (default: %(default)s)",
    )
    p.add_argument(
        "--autoscale-seconds",
        type=float,
        default=15.0,
        help="how often the autoscaler decides for each ModelDeployment with spec.autoscaling "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--operator-namespace",
        default=None,
        help="the namespace the operator's pods run in, which the runtime pods' NetworkPolicies admit "
        f"(default: the in-cluster ServiceAccount's, else {DEFAULT_OPERATOR_NAMESPACE})",
    )
    p.add_argument(
        "--node-cache-dir",
        default=NODE_CACHE_DIR,
        help="the directory on every node that ModelDeployments with model.nodeCache download into "
        "(a hostPath; it must be writable by uid 1000) (default: %(default)s)",
    )
    p.add_argument("--liveness", help="serve kopf's liveness probe, e.g. http://0.0.0.0:8081/healthz")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = p.parse_args(argv)
    if args.resync_seconds <= 0:
        p.error("--resync-seconds must be > 0")
    if args.autoscale_seconds <= 0:
        p.error("--autoscale-seconds must be > 0")
    return args


def own_namespace(token_dir: Path = SERVICE_ACCOUNT_DIR) -> str:
    """The namespace of the ServiceAccount the operator runs as in a pod, else the manifests' default."""
    try:
        return (token_dir / "namespace").read_text().strip() or DEFAULT_OPERATOR_NAMESPACE
    except OSError:
        return DEFAULT_OPERATOR_NAMESPACE


def load_client_configuration(kubeconfig: str | None, context: str | None) -> client.Configuration:
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
        return configuration
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(context=context, client_configuration=configuration)
    return configuration


def connection_info(configuration: client.Configuration) -> kopf.ConnectionInfo:
    """kopf's view of the same credentials the `kubernetes` client uses."""
    auth = (configuration.api_key or {}).get("authorization") or (configuration.api_key or {}).get(
        "BearerToken"
    )
    scheme, token = None, None
    if auth:
        scheme, _, token = auth.partition(" ") if " " in auth else ("Bearer", "", auth)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    configuration = load_client_configuration(args.kubeconfig, args.context)
    registry = kopf.OperatorRegistry()
    register(registry, args.resync_seconds, args.autoscale_seconds)

    @kopf.on.login(registry=registry)
    def _login(**_: Any) -> kopf.ConnectionInfo:
        # In-cluster tokens rotate: re-read them whenever kopf asks (on start and after a 401).
        fresh = load_client_configuration(args.kubeconfig, args.context)
        return connection_info(fresh)

    ctx = OperatorContext(
        kube=Kube(client.ApiClient(configuration)),
        image=args.image,
        resync_seconds=args.resync_seconds,
        operator_namespace=args.operator_namespace or own_namespace(),
        node_cache_dir=args.node_cache_dir,
    )
    kopf.run(
        registry=registry,
        memo=kopf.Memo(ctx=ctx),
        standalone=True,  # one replica (Recreate strategy); no peering objects needed
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
