"""compose.yaml against the Compose Specification's JSON schema, as
`docker compose config` would read it, with no container engine: the schema
check-jsonschema vendors."""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

COMPOSE = Path(__file__).parents[2] / "compose.yaml"


def _validator() -> jsonschema.Draft202012Validator:
    vendored = resources.files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return jsonschema.Draft202012Validator(json.loads(vendored.read_text()))


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def test_compose_yaml_follows_the_compose_specification() -> None:
    _validator().validate(_compose())


def test_a_misspelt_key_is_refused() -> None:
    broken = copy.deepcopy(_compose())
    broken["services"]["relay"]["healthchek"] = broken["services"]["relay"].pop("healthcheck")
    with pytest.raises(jsonschema.ValidationError):
        _validator().validate(broken)
