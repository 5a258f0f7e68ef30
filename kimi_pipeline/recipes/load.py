"""Loading recipes: presets, YAML files that extend a preset, `section.field=value` overrides, env aliases."""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr, ValidationError

from kimi_pipeline.errors import PermanentError
from kimi_pipeline.recipes.checks import Problem, check_recipe
from kimi_pipeline.recipes.recipe import Recipe

PRESET_PACKAGE = "kimi_pipeline.recipes.presets"

# Env flags the seeds' launchers set; they act as aliases of recipe fields (env wins, and says so).
ENV_ALIASES: dict[str, tuple[str, type]] = {
    "OPEN_TRAINING_INT4_FAKE_QAT_FLAG": ("quant.int4_qat", bool),
    "OPEN_TRAINING_INT4_GROUP_SIZE": ("quant.group_size", int),
}


class RecipeError(PermanentError, ValueError):
    """An invalid recipe: every problem names its field and the fix."""

    def __init__(self, source: str, problems: Sequence[Problem]):
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"recipe {source!r} is invalid ({len(self.problems)} problem(s)):\n{lines}")


def preset_names() -> list[str]:
    files = resources.files(PRESET_PACKAGE).iterdir()
    return sorted(f.name[:-5] for f in files if f.name.endswith(".yaml") and not f.name.startswith("_"))


def _read_yaml(text: str, origin: str) -> dict:
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise RecipeError(origin, [Problem("<file>", f"not valid YAML: {e}")]) from None
    if not isinstance(data, dict):
        raise RecipeError(origin, [Problem("<file>", "must be a YAML mapping of sections")])
    return data


def _preset_raw(name: str) -> dict:
    ref = resources.files(PRESET_PACKAGE) / f"{name}.yaml"
    if not ref.is_file():
        close = difflib.get_close_matches(name, preset_names(), n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise RecipeError(
            name, [Problem("<name>", f"no preset or file named {name!r}.{hint} Presets: {', '.join(preset_names())}")]
        )
    return _resolve_extends(_read_yaml(ref.read_text(), name), name, base_dir=None)


def _resolve_extends(data: dict, origin: str, base_dir: Path | None, depth: int = 0) -> dict:
    parent = data.pop("extends", None)
    if parent is None:
        return data
    if depth > 8:
        raise RecipeError(origin, [Problem("extends", "chain is deeper than 8 (a cycle?)")])
    candidate = (base_dir / parent) if base_dir is not None else None
    if candidate is not None and str(parent).endswith((".yaml", ".yml")) and candidate.is_file():
        base = _resolve_extends(_read_yaml(candidate.read_text(), str(candidate)), str(candidate), candidate.parent, depth + 1)
    else:
        ref = resources.files(PRESET_PACKAGE) / f"{parent}.yaml"
        if not ref.is_file():
            raise RecipeError(origin, [Problem("extends", f"unknown base recipe {parent!r}; presets: {', '.join(preset_names())}")])
        base = _resolve_extends(_read_yaml(ref.read_text(), parent), parent, None, depth + 1)
    return deep_merge(base, data)


def deep_merge(base: Mapping, over: Mapping) -> dict:
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _known_fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _field_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    ann = model.model_fields[key].annotation
    for cand in getattr(ann, "__args__", ()) or (ann,):
        if isinstance(cand, type) and issubclass(cand, BaseModel):
            return cand
    return None


def _secret_fields(model: type[BaseModel], prefix: str = "") -> frozenset[str]:
    """The dotted paths of the recipe's SecretStr fields (hub.token)."""
    out: set[str] = set()
    for name, field in model.model_fields.items():
        args = getattr(field.annotation, "__args__", ()) or (field.annotation,)
        if SecretStr in args:
            out.add(prefix + name)
        elif (sub := _field_model(model, name)) is not None:
            out |= _secret_fields(sub, f"{prefix}{name}.")
    return frozenset(out)


SECRET_FIELDS = _secret_fields(Recipe)


def _paths(keys: list[str], value: Any) -> list[str]:
    """Every dotted path an override sets: its own, and those inside a mapping it sets whole."""
    here = ".".join(keys)
    if isinstance(value, Mapping):
        return [here] + [p for k, v in value.items() for p in _paths(keys + [str(k)], v)]
    return [here]


def apply_override(data: dict, assignment: str) -> dict:
    """Apply one `section.field=value` (value parsed as a YAML scalar/list) with field-name checking."""
    if "=" not in assignment:
        raise RecipeError("--set", [Problem(assignment, "expected section.field=value, e.g. parallel.ep=16")])
    path, raw = assignment.split("=", 1)
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise RecipeError("--set", [Problem(assignment, "empty field name")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    secret = sorted(p for p in _paths(keys, value) if p in SECRET_FIELDS)
    if secret:  # `hub.token=…`, or the token inside a whole section: `hub={token: …}`
        raise RecipeError(
            "--set",
            [Problem(path, f"{', '.join(secret)}: secrets are not accepted as overrides (they would be stored as run "
                           "parameters); set HF_TOKEN or the Prefect Secret block 'hf-token'")],
        )
    model: type[BaseModel] | None = Recipe
    node = data
    for i, key in enumerate(keys):
        if model is not None and key not in model.model_fields:
            where = ".".join(keys[:i]) or "recipe"
            close = difflib.get_close_matches(key, _known_fields(model), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; fields: {', '.join(_known_fields(model))}"
            raise RecipeError("--set", [Problem(path, f"{where} has no field {key!r}{hint}")])
        if i == len(keys) - 1:
            node[key] = value
        else:
            nxt = node.get(key)
            if not isinstance(nxt, dict):
                nxt = {}
                node[key] = nxt
            node = nxt
            model = _field_model(model, key) if model is not None else None
    return data


def _env_overrides(env: Mapping[str, str]) -> list[str]:
    out = []
    for var, (field, typ) in ENV_ALIASES.items():
        if var in env and env[var].strip() != "":
            raw = env[var].strip()
            val = (raw.lower() in ("1", "true", "yes", "on")) if typ is bool else int(raw)
            out.append(f"{field}={str(val).lower() if typ is bool else val}")
    return out


def load_recipe(
    name_or_path: str | os.PathLike = "tiny",
    overrides: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> Recipe:
    """Load a preset name or a YAML file (which may `extends:` a preset), apply overrides, validate."""
    env = os.environ if env is None else env
    src = str(name_or_path)
    path = Path(src)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise RecipeError(src, [Problem("<file>", f"recipe file {path} does not exist")])
        data = _resolve_extends(_read_yaml(path.read_text(), src), src, path.parent)
        data.setdefault("name", path.stem)
    else:
        data = _preset_raw(src)
    for assignment in [*_env_overrides(env), *overrides]:
        data = apply_override(data, assignment)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        problems = [
            Problem(".".join(str(x) for x in err["loc"]) or "<recipe>", _pydantic_msg(err)) for err in e.errors()
        ]
        raise RecipeError(src, problems) from None
    if check:
        problems = check_recipe(recipe)
        if problems:
            raise RecipeError(src, problems)
    return recipe


def _pydantic_msg(err: Mapping[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field (typo?); remove it or check `kimi recipe show` for the field names"
    if err["type"] == "missing":
        return "required field is missing"
    return f"{err['msg']} (got {err.get('input')!r})"


def recipe_to_yaml(recipe: Recipe) -> str:
    data = recipe.worker_dump()
    return yaml.safe_dump(data, sort_keys=False)
