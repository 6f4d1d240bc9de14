"""Config files: one way to read a YAML file into a pydantic schema, and one way to override its fields.

Both the runtime pod (`RuntimeConfig`) and the router (`RouterConfig`) read their config from a mounted
ConfigMap and may take command-line overrides. Whatever the source, the result is validated whole: an
override is merged into the file's data and the schema validates the merge, so `--port 70000` fails exactly
like `port: 70000` in the file would (pydantic's `model_copy(update=...)` skips validation, so it is not
used for this). Importable without torch: the operator and the router use it too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from tokenfleet.runtime.errors import ConfigError

Schema = TypeVar("Schema", bound=BaseModel)


def parse_config(schema: type[Schema], text: str, source: str | Path, what: str = "config") -> Schema:
    """Validate YAML `text` against `schema`; ConfigError names `source` and says what is wrong."""
    try:
        data = yaml.safe_load(text) or {}
        return schema.model_validate(data)
    except (yaml.YAMLError, ValidationError, ValueError) as e:
        raise ConfigError(f"invalid {what} {source}: {e}") from e


def load_config(schema: type[Schema], path: str | Path, what: str = "config") -> Schema:
    """Read and validate a config file; an unreadable file is a ConfigError like an invalid one."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"invalid {what} {path}: {e}") from e
    return parse_config(schema, text, path, what)


def with_overrides(config: Schema, overrides: Mapping[str, Any], what: str = "config") -> Schema:
    """`config` with top-level `overrides` (None values skipped), validated again as a whole."""
    updates = {k: v for k, v in overrides.items() if v is not None}
    if not updates:
        return config
    data = config.model_dump(mode="json", by_alias=False) | updates
    try:
        return type(config).model_validate(data)
    except (ValidationError, ValueError) as e:
        raise ConfigError(f"invalid {what} override {sorted(updates)}: {e}") from e
