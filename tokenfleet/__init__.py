"""tokenfleet: Kubernetes-native LLM serving.

`tokenfleet.runtime` (engine, server, router), `tokenfleet.operator` (kopf operator) and
`tokenfleet.kernels` (Triton kernels) live in the repository's top-level folders; pyproject.toml maps them.
"""

__version__ = "0.1.0"
