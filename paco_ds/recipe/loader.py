"""Recipe loading, for any schema: YAML with `extends:` and `--set`, and one-line errors.

A recipe is a YAML file validated against a pydantic schema (unknown keys forbidden).
`extends: base.yaml` (a path relative to the file, or a list of them) merges the base first;
`--set a.b=c` overrides apply last, values parsed as YAML. Every key remembers the file:line it
came from, so a mistake is reported as one line that names the place and the key.

Names that live in registries above the schema (rewards, policies, losses) are checked through
pydantic's validation context: the caller passes the tables (`context=`), so the schema modules
import nothing from the layers that use them. Each of those registries (and the aggregations)
also takes an out-of-tree implementation by its import path, "module:attr", resolved by `resolve`
when it is built.
"""
from __future__ import annotations

import copy
import difflib
import importlib
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml
from pydantic import BaseModel, ValidationError, ValidationInfo

from paco_ds.errors import ConfigError


def suggest(name: str, choices) -> str:
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def check_name(value: str, info: ValidationInfo, table: str, what: str) -> str:
    """In a field validator: `value` must be a key of the registry `table` of the validation
    context (when the loader gave one) or an import path "module:attr", else a message with the
    closest name and the known ones. An import path is imported when it is built (`resolve`)."""
    if ":" in value:
        module, _, attr = value.partition(":")
        if not module or not attr:
            raise ValueError(f"'{value}' is not an import path 'module:attr'")
        return value
    names: Iterable[str] | None = (info.context or {}).get(table)
    if names is not None and value not in names:
        raise ValueError(f"unknown {what} '{value}'{suggest(value, names)}; known: {', '.join(sorted(names))} "
                         "(or 'module:attr')")
    return value


def resolve(value: str, table: dict[str, str], key: str, what: str) -> Any:
    """What a registry name (a key of `table`, whose values are "module:attr") or an import path
    "module:attr" of an out-of-tree implementation names, imported now; an unknown name or a path
    that does not import is a ConfigError naming the config key `key`."""
    spec = value if ":" in value else table.get(value)
    if spec is None:
        raise ConfigError(f"config key '{key}': unknown {what} '{value}'{suggest(value, table)}; "
                          f"known: {', '.join(sorted(table))} (or 'module:attr')")
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"config key '{key}': '{value}' names no {what}: write 'module:attr' (both parts)")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:  # ValueError: e.g. a relative module name
        raise ConfigError(f"config key '{key}': cannot import {what} '{value}' ({err})") from None


# A recipe has hundreds of nodes; a document whose aliases expand past this many is an alias bomb
# (each level of `&a [*b, *b, ...]` multiplies the size), which safe_load would build for minutes
# and gigabytes.
MAX_EXPANDED_NODES = 100_000


def _checked_root(text: str, file: str):
    """The composed YAML node tree (aliases are shared nodes here, not yet copies), after refusing
    a key repeated in one mapping (YAML would silently keep the last value) and a document whose
    aliases expand past MAX_EXPANDED_NODES. Errors are one line naming file:line."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    sizes: dict[int, int] = {}  # expanded size per node, memoised: shared (aliased) nodes are counted once each
    open_nodes: set[int] = set()  # the mappings and lists being walked: the path from the root

    def size(node) -> int:
        if id(node) in open_nodes:  # safe_load would build a structure that contains itself
            raise ConfigError(f"{file}:{node.start_mark.line + 1}: an alias (*anchor) refers to a mapping or list "
                              "that contains it (the one anchored here); a recipe is a tree, so refer to a value "
                              "outside it")
        if id(node) in sizes:
            return sizes[id(node)]
        n = 1
        open_nodes.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: dict[tuple, int] = {}
            for knode, vnode in node.value:
                if not isinstance(knode, yaml.ScalarNode):  # `? [train, seed]`: a list or mapping as a key
                    raise ConfigError(f"{file}:{knode.start_mark.line + 1}: a key must be a name, not a "
                                      f"{'list' if isinstance(knode, yaml.SequenceNode) else 'mapping'}")
                if knode.tag != "tag:yaml.org,2002:merge":
                    key = (knode.tag, knode.value)
                    if key in seen:
                        raise ConfigError(f"{file}:{knode.start_mark.line + 1}: key '{knode.value}' is repeated in "
                                          f"this mapping (first at line {seen[key]}); give each key once")
                    seen[key] = knode.start_mark.line + 1
                n += size(knode) + size(vnode)
        elif isinstance(node, yaml.SequenceNode):
            n += sum(size(v) for v in node.value)
        open_nodes.discard(id(node))
        if n > MAX_EXPANDED_NODES:
            raise ConfigError(f"{file}:{node.start_mark.line + 1}: the document expands past "
                              f"{MAX_EXPANDED_NODES:,} values through its aliases (&anchor / *alias); refused")
        sizes[id(node)] = n
        return n

    if root is not None:
        size(root)
    return root


def safe_load_checked(text: str, file: str):
    """yaml.safe_load, after _checked_root's checks (repeated keys, alias bombs)."""
    if _checked_root(text, file) is None:
        return None
    return yaml.safe_load(text)


def _locations(text: str, file: str) -> dict[tuple, str]:
    """Map each key path of a YAML document to 'file:line' (after _checked_root's checks, so the
    walk below expands a bounded document)."""
    out: dict[tuple, str] = {}

    def walk(node, prefix: tuple) -> None:
        if isinstance(node, yaml.MappingNode):
            for knode, vnode in node.value:
                key = prefix + (knode.value,)
                out[key] = f"{file}:{knode.start_mark.line + 1}"
                walk(vnode, key)

    root = _checked_root(text, file)
    if root is not None:
        walk(root, ())
    return out


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and not v.get("_replace", False):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
            if isinstance(v, dict):
                out[k].pop("_replace", None)
    return out


def _strip_markers(data):
    """Drop merge markers (`_replace: true`) left where nothing was merged."""
    if isinstance(data, dict):
        return {k: _strip_markers(v) for k, v in data.items() if k != "_replace"}
    return data


def _read_yaml(path: Path, stack: tuple = ()) -> tuple[dict, dict[tuple, str]]:
    if not path.is_file():
        where = f" (extended from {stack[-1]})" if stack else ""
        raise ConfigError(f"config file not found: {path}{where}")
    if path.resolve() in stack:
        raise ConfigError(f"{path}: circular 'extends'")
    text = read_text_utf8(path)
    try:
        locs = _locations(text, _display(path))  # first: it refuses repeated keys and alias bombs
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{_display(path)}{line}: invalid YAML ({getattr(err, 'problem', err)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{_display(path)}: a recipe must be a mapping of keys")
    extends = data.pop("extends", None)
    if extends is None:
        return data, locs
    bases = [extends] if isinstance(extends, str) else extends
    if not isinstance(bases, list) or not all(isinstance(b, str) and b.strip() for b in bases):
        where = locs.get(("extends",), _display(path))
        raise ConfigError(f"{where}: config key 'extends' must be a file name or a list of file names "
                          f"(got {extends!r})")
    merged: dict = {}
    merged_locs: dict[tuple, str] = {}
    for base in bases:
        bdata, blocs = _read_yaml((path.parent / base), stack + (path.resolve(),))
        merged = _deep_merge(merged, bdata)
        merged_locs.update(blocs)
    merged_locs.update(locs)
    return _deep_merge(merged, data), merged_locs


def read_text_utf8(path: Path, error=ConfigError) -> str:
    """A text file that must be UTF-8; otherwise one line naming the file, line and byte."""
    raw = Path(path).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise error(f"{_display(Path(path))}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset "
                    f"{err.start}); save the file as UTF-8") from None


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key.path=value")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = safe_load_checked(raw, f"--set {item}") if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return keys, value


def apply_overrides(data: dict, overrides: list[str], locs: dict[tuple, str]) -> dict:
    data = copy.deepcopy(data)
    for item in overrides or []:
        keys, value = parse_override(item)
        node = data
        replaced = len(keys)  # from this depth on, the keys' values are the --set's own
        for n, k in enumerate(keys[:-1], 1):
            if not isinstance(node.get(k), dict):
                node[k] = {}
                replaced = min(replaced, n)  # a value the file set (or nothing) became a mapping
            node = node[k]
        node[keys[-1]] = value
        for n in range(1, len(keys) + 1):
            if n >= replaced or tuple(keys[:n]) not in locs:
                locs[tuple(keys[:n])] = f"--set {item}"
    return data


def _model_fields(model: type[BaseModel], path: tuple) -> list[str]:
    """Valid keys at a path of the schema (for 'did you mean')."""
    for key in path:
        field = model.model_fields.get(key)
        if field is None:
            return []
        ann = field.annotation
        sub = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _format_validation_error(err: ValidationError, locs: dict[tuple, str], source: str,
                             schema: type[BaseModel]) -> str:
    errors = err.errors()
    e = dict(errors[0])
    # A union's members add their own tag to the location ("literal['mean','median']", "float"):
    # name the key alone, with what each member would have accepted.
    key_loc = tuple(str(x) for x in e["loc"] if not _is_union_tag(x))
    if len(key_loc) < len(e["loc"]):
        same = [x for x in errors if tuple(str(y) for y in x["loc"] if not _is_union_tag(y)) == key_loc]
        e["loc"], e["msg"] = key_loc, " or ".join(dict.fromkeys(x["msg"] for x in same))
    loc = tuple(str(x) for x in e["loc"])
    dotted = ".".join(loc)
    if not loc or e["type"] == "value_error" and _named_keys(e["msg"], locs, loc):
        # A cross-check of several keys (a model validator): name each key and where it was set.
        keys = _named_keys(e["msg"], locs, loc)
        msg = e["msg"].removeprefix("Value error, ")
        if keys:
            return "config keys " + ", ".join(f"'{k}' ({w})" for k, w in keys) + f": {msg}"
        return f"{source}: {msg}"
    # The most specific location we know.
    where = source
    for n in range(len(loc), 0, -1):
        if loc[:n] in locs:
            where = locs[loc[:n]]
            break
    # A validator on a mapping (e.g. reward names) names the bad entry in its message: point at it.
    named = [(e["msg"].find(f"'{k[len(loc)]}'"), place) for k, place in locs.items()
             if len(k) == len(loc) + 1 and k[:len(loc)] == loc and f"'{k[len(loc)]}'" in e["msg"]]
    if named:
        where = min(named)[1]
    if e["type"] == "extra_forbidden":
        close = difflib.get_close_matches(loc[-1], _model_fields(schema, loc[:-1]), n=1, cutoff=0.6)
        hint = f" (did you mean '{'.'.join(loc[:-1] + (close[0],))}'?)" if close else ""
        return f"{where}: unknown config key '{dotted}'{hint}"
    if e["type"] == "missing":
        return f"{where}: missing required config key '{dotted}'"
    msg = e["msg"].removeprefix("Value error, ")
    got = e.get("input")
    got_s = "" if isinstance(got, (dict, list)) or e["type"].startswith("value_error") else f" (got {got!r})"
    return f"{where}: config key '{dotted}': {msg}{got_s}"


def _is_union_tag(part) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("float", "int", "str", "bool"))


def _named_keys(msg: str, locs: dict[tuple, str], loc: tuple) -> list[tuple[str, str]]:
    """The dotted config keys (outside `loc`'s own) a validator's message names, in order, with
    where each was set; a key set nowhere is reported as its default."""
    import re

    found = []
    for m in re.finditer(r"\b([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)\b", msg):
        key = tuple(m.group(1).split("."))
        if key == loc or any(k == m.group(1) for k, _ in found):
            continue
        if len(key) >= 2 and (key in locs or not loc):
            found.append((m.group(1), locs.get(key, "default")))
    return found


def add_recipe_arguments(parser) -> None:
    """The arguments every entry point that runs a recipe shares: --config, --set, and the launcher's rank."""
    import argparse
    import os

    parser.add_argument("--config", required=True, help="recipe YAML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (repeatable), e.g. --set train.learning_rate=1e-4")
    # the deepspeed launcher passes --local_rank; the rank itself is read from LOCAL_RANK
    parser.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")),
                        help=argparse.SUPPRESS)


def load_recipe(path: str | Path, overrides: list[str] | None,
                schema: type[BaseModel] | Callable[[dict], type[BaseModel]], context: dict[str, Any] | None = None):
    """Load a recipe, apply `extends` and `--set` overrides, and validate it against `schema`
    (which needs a `source` field), or against the schema `schema(data)` returns for the merged
    recipe (one composed from registries); `context` carries the registries the validators check
    names against."""
    path = Path(path)
    data, locs = _read_yaml(path)
    data = _strip_markers(apply_overrides(data, overrides or [], locs))
    data["source"] = str(path.resolve())
    if not isinstance(schema, type):
        schema = schema(data)
    try:
        return schema.model_validate(data, context=context)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, locs, _display(path), schema)) from None


def recipe_to_yaml(cfg: BaseModel) -> str:
    data = cfg.model_dump(mode="json", exclude={"source"})
    return yaml.safe_dump(data, sort_keys=False)
