"""CRD fields that *are* RuntimeConfig fields: declared once, in runtime/config.py.

`runtime_field("cache.eviction")` is the annotation of a CRD field that the runtime pods also have: the
runtime's type (enum), constraints and default, plus a marker naming the path. `runtime_values(spec)`
collects every marked field of a parsed spec by that path, and builders.py writes them into the pod's
RuntimeConfig as they are. So a runtime default, bound or enum can never drift from the CRD, and no field
is mapped by hand; a field the CRD spells differently (nested under `prefixCaching`, say) just names its
runtime path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, Field
from tokenfleet.runtime.config import RuntimeConfig


@dataclass(frozen=True, slots=True)
class RuntimePath:
    """Marks a CRD field as the RuntimeConfig field at `path` (dotted: "cache.eviction")."""

    path: str


def runtime_field(path: str, description: str | None = None, **field: Any) -> Any:
    """The type, constraints and default of a RuntimeConfig field, as the annotation of a CRD field.

    `field` passes on to `Field` (e.g. an `alias`); `annotation=` narrows the type where the CRD needs a
    structural schema (a union the runtime accepts from files but a CRD cannot express).
    """
    section, name = path.split(".")
    info = RuntimeConfig.model_fields[section].annotation.model_fields[name]
    annotation = field.pop("annotation", info.annotation)
    default = Field(default=info.default, description=description or info.description, **field)
    return Annotated[annotation, *info.metadata, RuntimePath(path), default]


def runtime_values(spec: BaseModel) -> dict[str, Any]:
    """{RuntimeConfig dotted path: value} of every field of `spec` (nested) declared with runtime_field."""
    values: dict[str, Any] = {}
    for name, info in type(spec).model_fields.items():
        value = getattr(spec, name)
        marker = next((m for m in info.metadata if isinstance(m, RuntimePath)), None)
        if marker is not None:
            values[marker.path] = value
        elif isinstance(value, BaseModel):
            values.update(runtime_values(value))
    return values
