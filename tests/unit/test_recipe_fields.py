"""Every recipe field is read somewhere: a field nobody reads is a knob that does nothing.

A static tripwire, not a proof. The field paths come from the pydantic models (`Recipe` and its nested
sections); the readers come from an `ast` scan of the library code (kimi_pipeline/, tasks/, flows/, bench/),
not the tests and not the modules that define the fields. A field counts as read when code reads it:

- `x.field` (Load) or `getattr(x, "field")` where `x` is known to be that field's section (annotated as
  `ParallelSpec`/`Recipe`, bound by `p = recipe.parallel` or `m, p = r.model, r.parallel`, or an attribute chain
  such as `recipe.eval.top_p`). So `eval.top_p` is not satisfied by `recipe.rollout.top_p`.
- for a field name that only one field path carries, any `.field` read or `"field"` key (d["field"],
  d.get("field")) counts even where the scan cannot tell what `x` is (loose, on purpose).
- a property/method of the models (`cluster.world_size`, `Source.describe()`, `Recipe.global_batch_size` ...)
  counts as reading the fields its body reads, when code reads that property.
- `getattr(spec, name)` with a computed name on a known section counts for that section's fields whose names
  appear as string constants in the same module (`SHAPE_KEYS` tables).

Not counted: `kimi_pipeline/recipes/checks.py` (validating a field does not make it do anything; a field only
checks.py reads is reported as "validated only"), bulk dumps (`model_dump()` into a W&B config, a job file or
recipe.yaml: the far side re-validates the recipe and reads its fields by name, which this scan sees).
"""

from __future__ import annotations

import ast
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, create_model

from kimi_pipeline.recipes.models import RolloutSpec, Section
from kimi_pipeline.recipes.recipe import Recipe

ROOT = Path(__file__).resolve().parents[2]
SCAN_DIRS = ("kimi_pipeline", "tasks", "flows", "bench")
DEFINITIONS = ("kimi_pipeline/recipes/models.py", "kimi_pipeline/recipes/recipe.py")
VALIDATION = ("kimi_pipeline/recipes/checks.py",)

# Fields that legitimately do nothing at run time (pure metadata), "path": "one-line reason". Empty today:
# `description` is read by `kimi recipe list`. Never park a behaviour field here to make the test pass.
NOT_BEHAVIOUR: dict[str, str] = {}

# Names that denote a section even where no annotation says so (`self.recipe = recipe`).
NAME_HINTS = {"recipe": ""}

Types = frozenset  # of section paths ("" = the Recipe itself, "hub.model" = a nested section)


# ---------------------------------------------------------------- the schema, from the models


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


@dataclass
class Schema:
    sections: dict[str, tuple[type[BaseModel], ...]] = field(default_factory=dict)  # section path -> model(s)
    leaves: dict[str, tuple[str, str]] = field(default_factory=dict)  # leaf path -> (section path, field name)
    child: dict[tuple[str, str], str] = field(default_factory=dict)  # (section, field) -> nested section path
    by_class: dict[str, set[str]] = field(default_factory=dict)  # model class name (and its bases) -> section paths
    by_attr: dict[str, set[str]] = field(default_factory=dict)  # field name -> nested section paths it leads to

    def add(self, path: str, models: tuple[type[BaseModel], ...]) -> None:
        self.sections[path] = models
        for m in models:
            for k in m.__mro__:
                if isinstance(k, type) and issubclass(k, Section) and k is not Section:
                    self.by_class.setdefault(k.__name__, set()).add(path)
            for name, info in m.model_fields.items():
                sub = f"{path}.{name}" if path else name
                nested = tuple(_models_in(info.annotation))
                if nested:
                    self.child[(path, name)] = sub
                    self.by_attr.setdefault(name, set()).add(sub)
                    self.add(sub, nested)
                else:
                    self.leaves[sub] = (path, name)

    def fields_of(self, path: str) -> set[str]:
        return {n for m in self.sections[path] for n in m.model_fields}

    def field_info(self, leaf: str):
        path, name = self.leaves[leaf]
        return next(m.model_fields[name] for m in self.sections[path] if name in m.model_fields)


def build_schema(root: type[BaseModel] = Recipe) -> Schema:
    s = Schema()
    s.add("", (root,))
    return s


def _derived_methods() -> dict[str, dict[str, ast.FunctionDef]]:
    """class name -> {property/method name: its def}, from the definition modules."""
    out: dict[str, dict[str, ast.FunctionDef]] = {}
    for rel in DEFINITIONS:
        for node in ast.parse((ROOT / rel).read_text()).body:
            if isinstance(node, ast.ClassDef):
                out[node.name] = {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}
    return out


# ---------------------------------------------------------------- the scan


@dataclass
class Reads:
    resolved: set[tuple[str, str]] = field(default_factory=set)  # (section path, field name) read on a known section
    loose: set[str] = field(default_factory=set)  # names read on something the scan could not place


class _Scanner:
    def __init__(self, schema: Schema, derived: dict[str, dict[str, ast.FunctionDef]], reads: Reads):
        self.s, self.derived, self.reads = schema, derived, reads
        self.module_strings: set[str] = set()
        self._expanding: set[tuple[str, str]] = set()

    # -- what an expression denotes: a set of section paths, or None when unknown
    def annotation_types(self, ann: ast.AST | None) -> Types | None:
        if ann is None:
            return None
        paths: set[str] = set()
        for n in ast.walk(ann):
            names = []
            if isinstance(n, ast.Name):
                names = [n.id]
            elif isinstance(n, ast.Attribute):
                names = [n.attr]
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                try:
                    sub = self.annotation_types(ast.parse(n.value, mode="eval"))
                except SyntaxError:
                    sub = None
                paths |= sub or set()
            for nm in names:
                paths |= self.s.by_class.get(nm, set())
        return Types(paths) or None

    def type_of(self, e: ast.AST, env: dict[str, Types]) -> Types | None:
        if isinstance(e, ast.Name):
            if e.id in env:
                return env[e.id]
            return Types({NAME_HINTS[e.id]}) if e.id in NAME_HINTS else None
        if isinstance(e, ast.Attribute):
            base = self.type_of(e.value, env)
            if base is not None:
                return Types(self.s.child[(p, e.attr)] for p in base if (p, e.attr) in self.s.child) or None
            if e.attr in NAME_HINTS:
                return Types({NAME_HINTS[e.attr]})
            return Types(self.s.by_attr.get(e.attr, ())) or None
        if isinstance(e, ast.Call):
            f = e.func
            if isinstance(f, ast.Name) and f.id == "load_recipe":
                return Types({""})
            if isinstance(f, ast.Name) and f.id in self.s.by_class:  # Recipe(...), ModelSpec(...)
                return Types(self.s.by_class[f.id])
            if isinstance(f, ast.Attribute) and f.attr in ("model_validate", "model_construct"):
                return self.annotation_types(f.value)
            if isinstance(f, ast.Attribute) and f.attr == "model_copy":
                return self.type_of(f.value, env)
            return None
        if isinstance(e, (ast.IfExp, ast.BoolOp)):
            parts = [e.body, e.orelse] if isinstance(e, ast.IfExp) else e.values
            ts = [self.type_of(p, env) for p in parts]
            known = [t for t in ts if t]
            return Types().union(*known) if known else None
        if isinstance(e, ast.NamedExpr):
            return self.type_of(e.value, env)
        return None

    # -- scopes
    def _bind(self, target: ast.AST, value: ast.AST | None, env: dict, ann: ast.AST | None = None) -> None:
        if isinstance(target, ast.Name):
            t = self.annotation_types(ann) if ann is not None else None
            t = t or (self.type_of(value, env) if value is not None else None)
            if t:
                env[target.id] = env.get(target.id, Types()) | t
        elif isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            for tg, v in zip(target.elts, value.elts):
                self._bind(tg, v, env)

    def scope_env(self, body: list[ast.AST], parent: dict, args: ast.arguments | None = None) -> dict:
        env = dict(parent)
        if args is not None:
            for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if a is not None:
                    env.pop(a.arg, None)
                    t = self.annotation_types(a.annotation)
                    if t:
                        env[a.arg] = t
        assigns = []
        stack = list(body)
        while stack:  # this scope's assignments, not those of nested defs/classes
            n = stack.pop(0)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(n, ast.Assign):
                assigns += [(t, n.value, None) for t in n.targets]
            elif isinstance(n, ast.AnnAssign):
                assigns.append((n.target, n.value, n.annotation))
            stack.extend(ast.iter_child_nodes(n))
        for _ in range(2):  # `ro = r.rollout` after `r = ...`
            for target, value, ann in assigns:
                self._bind(target, value, env, ann)
        return env

    # -- reads
    def record(self, base: Types | None, name: str) -> None:
        if base is None:
            self.reads.loose.add(name)
            for cls, methods in self.derived.items():  # `.world_size` on something unknown: loose too
                if name in methods and cls in self.s.by_class:
                    sub = Reads()
                    _Scanner(self.s, self.derived, sub).expand(Types(self.s.by_class[cls]), methods[name])
                    self.reads.loose |= sub.loose | {n for _, n in sub.resolved}
            return
        for p in base:
            if name in self.s.fields_of(p):
                self.reads.resolved.add((p, name))
                continue
            for m in self.s.sections[p]:
                for k in m.__mro__:
                    fn = self.derived.get(k.__name__, {}).get(name)
                    if fn is not None and (p, name) not in self._expanding:
                        self._expanding.add((p, name))
                        self.expand(Types({p}), fn)

    def expand(self, self_types: Types, fn: ast.FunctionDef) -> None:
        env = self.scope_env(fn.body, {}, fn.args)
        if fn.args.args:  # `self`
            env[fn.args.args[0].arg] = self_types
        for stmt in fn.body:
            self.visit(stmt, env)

    def visit(self, node: ast.AST, env: dict) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for d in [*node.decorator_list, *node.args.defaults, *node.args.kw_defaults]:
                if d is not None:
                    self.visit(d, env)
            inner = self.scope_env(node.body, env, node.args)
            for stmt in node.body:
                self.visit(stmt, inner)
            return
        if isinstance(node, ast.Lambda):
            self.visit(node.body, self.scope_env([], env, node.args))
            return
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            self.record(self.type_of(node.value, env), node.attr)
        elif isinstance(node, ast.Call):
            f, args = node.func, node.args
            if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and len(args) >= 2:
                key = args[1]
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    self.record(self.type_of(args[0], env), key.value)
                else:  # getattr(spec, attr) over a table of names in this module
                    base = self.type_of(args[0], env)
                    for p in base or ():
                        for name in self.s.fields_of(p) & self.module_strings:
                            self.reads.resolved.add((p, name))
            elif isinstance(f, ast.Attribute) and f.attr in ("get", "pop", "setdefault") and args:
                if isinstance(args[0], ast.Constant) and isinstance(args[0].value, str):
                    self.reads.loose.add(args[0].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                self.reads.loose.add(node.slice.value)
        for child in ast.iter_child_nodes(node):
            self.visit(child, env)

    def scan(self, tree: ast.Module) -> None:
        self.module_strings = {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
        }
        env = self.scope_env(tree.body, {})
        for stmt in tree.body:
            self.visit(stmt, env)


def library_sources() -> dict[str, str]:
    """relative path -> source of every module the scan reads (validation modules included; callers split)."""
    out = {}
    for d in SCAN_DIRS:
        for f in sorted((ROOT / d).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if rel not in DEFINITIONS and "/tests/" not in f"/{rel}":
                out[rel] = f.read_text()
    return out


def scan(sources: dict[str, str], schema: Schema) -> Reads:
    reads = Reads()
    derived = _derived_methods()
    for rel, text in sources.items():
        _Scanner(schema, derived, reads).scan(ast.parse(text, filename=rel))
    return reads


def is_read(schema: Schema, reads: Reads, leaf: str) -> bool:
    path, name = schema.leaves[leaf]
    if (path, name) in reads.resolved:
        return True
    unique = sum(1 for _, n in schema.leaves.values() if n == name) == 1
    return unique and name in reads.loose


def unread_fields(schema: Schema, sources: dict[str, str] | None = None) -> dict[str, str]:
    """leaf path -> why it counts as unread ("never read" / "validated only (checks.py)")."""
    sources = library_sources() if sources is None else sources
    code = scan({k: v for k, v in sources.items() if k not in VALIDATION}, schema)
    checks = scan({k: v for k, v in sources.items() if k in VALIDATION}, schema)
    out = {}
    for leaf in schema.leaves:
        if not is_read(schema, code, leaf):
            out[leaf] = "validated only (checks.py)" if is_read(schema, checks, leaf) else "never read"
    return out


# ---------------------------------------------------------------- the tests


def _describe(schema: Schema, leaf: str) -> str:
    """Where the field is defined, which presets set it, and its documentation."""
    path, name = schema.leaves[leaf]
    lines: dict[tuple[str, str], str] = {}
    for rel in DEFINITIONS:
        for cls in ast.parse((ROOT / rel).read_text()).body:
            if isinstance(cls, ast.ClassDef):
                for stmt in cls.body:
                    if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                        lines[(cls.name, stmt.target.id)] = f"{rel}:{stmt.lineno}"
    where = next((lines[(k.__name__, name)] for m in schema.sections[path] for k in m.__mro__
                  if (k.__name__, name) in lines), "?")
    presets = []
    for f in sorted((ROOT / "kimi_pipeline/recipes/presets").glob("*.yaml")):
        node = yaml.safe_load(f.read_text()) or {}
        for key in leaf.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:
            presets.append(f.stem)
    info = schema.field_info(leaf)
    return (f" ({where}; set by presets: {', '.join(presets) or 'none'})"
            + (f" -- {info.description}" if info.description else ""))


def test_every_recipe_field_is_read():
    schema = build_schema()
    unread = {k: v for k, v in unread_fields(schema).items() if k not in NOT_BEHAVIOUR}
    lines = [f"  {leaf}: {why}{_describe(schema, leaf)}" for leaf, why in sorted(unread.items())]
    assert not unread, (
        f"{len(unread)} recipe field(s) are read by no code path (a knob that does nothing):\n" + "\n".join(lines)
        + "\nRead each where it takes effect (plan, trainer, engine, stage), or delete it from "
        "kimi_pipeline/recipes/models.py and the presets (kimi_pipeline/recipes/presets/*.yaml). Pure metadata "
        "goes in NOT_BEHAVIOUR in tests/unit/test_recipe_fields.py with a one-line reason."
    )


def test_allowlist_names_real_fields():
    leaves = build_schema().leaves
    assert not [k for k in NOT_BEHAVIOUR if k not in leaves], "NOT_BEHAVIOUR names a field that no longer exists"


def test_scan_finds_known_reads_and_reports_a_fake_field():
    probe = create_model("RolloutSpecProbe", __base__=RolloutSpec, zzz_fake_knob=(int, 0))
    schema = build_schema(create_model("RecipeProbe", __base__=Recipe, rollout=(probe, ...)))
    assert "rollout.zzz_fake_knob" in schema.leaves and "hub.model.kind" in schema.leaves
    unread = unread_fields(schema)
    assert unread.get("rollout.zzz_fake_knob") == "never read"
    for leaf in ("rollout.num_rollout", "rollout.top_k", "sglang.mem_fraction_static", "model.num_layers",
                 "eval.interval", "cluster.nodes"):
        assert leaf not in unread, leaf


def test_scan_tells_sections_apart():
    schema = build_schema()
    src = (
        "def f(r: Recipe, spec: 'ConvertSpec'):\n"
        "    ev = r.eval\n"
        "    m, ro = r.model, r.rollout\n"
        "    return ev.top_p, spec.tp, ro.samples_per_rollout, r.cluster.world_size, r.hub.model.describe()\n"
        "def g(x):\n"
        "    return x.temperature, x.seed\n"
    )
    reads = scan({"probe.py": src}, schema)
    read = {leaf for leaf in schema.leaves if is_read(schema, reads, leaf)}
    assert {"eval.top_p", "convert.tp", "rollout.rollout_batch_size", "rollout.n_samples_per_prompt",
            "cluster.nodes", "cluster.gpus_per_node", "hub.model.kind", "hub.model.repo_id", "rollout.seed"} <= read
    # same names on other sections; `x.temperature` on an unknown object cannot tell eval from rollout
    assert not {"rollout.top_p", "parallel.tp", "eval.n_samples_per_prompt", "convert.nodes", "data.eval.kind",
                "rollout.temperature", "eval.temperature"} & read
    # checks.py reading a field does not make it used
    checks_only = {"kimi_pipeline/recipes/checks.py": "def c(r: Recipe):\n    r.quant.group_size\n"}
    only_checked = unread_fields(schema, checks_only)
    assert only_checked["quant.group_size"] == "validated only (checks.py)"

