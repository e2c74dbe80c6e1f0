"""Which JSON Schemas (and regexes) the engine's grammar compiler, xgrammar 0.2.9, enforces as
written: checked at the gateway, so that a constraint a client asks for is honoured or refused
with a 400 naming its keyword and path, never dropped on the way.

Where xgrammar meets a keyword it cannot express it mostly logs a warning and goes on without
it, and the output may then break the schema. Each rule below was found by compiling a schema
with a value that breaks the keyword (``xgrammar.testing._is_grammar_accept_string``; the
engine compiles in its default strict mode):

- never enforced: ``not``, ``if``/``then``/``else``, ``dependentRequired``,
  ``dependentSchemas``, ``dependencies``, ``uniqueItems: true``, ``contains``/``minContains``/
  ``maxContains``, ``contentEncoding``/``contentMediaType``/``contentSchema``,
  ``$dynamicRef``/``$recursiveRef``, a ``$ref`` outside the document (or to an ``$anchor``),
  a ``format`` outside ``FORMATS``, ``multipleOf`` on numbers (and on integers unless a whole
  number up to 1,024), ``allOf`` of more than one schema (any value passes);
- enforced alone, ignored beside another: a schema with ``$ref``, ``const``, ``enum``,
  ``anyOf``, ``oneOf`` or ``allOf`` follows that keyword alone (in that order) and ignores
  every other constraint beside it (an ``enum`` ignores its ``type``: each value must have
  it); ``minLength``/``maxLength`` beside ``pattern`` or ``format``; ``pattern`` beside
  ``format``; ``propertyNames`` for the names in ``properties``; a ``required`` name missing
  from ``properties``;
- without a ``type`` (or ``properties``/``items``, which imply object/array) any value passes,
  so a type's own constraints there (``minimum``, ``pattern``, ``required``, …) are ignored;
- ``oneOf`` is enforced as ``anyOf``: right only when at most one branch can match, which is
  proved here (branches of different types, disjoint ``const``/``enum`` values, or objects
  that require one property whose ``const``/``enum`` values differ);
- a regex (``pattern``, ``patternProperties``' names, a regex constraint) loses its
  lookahead (``(?=``, ``(?!``), an anchor in its middle, and reads an unknown escape such as
  ``\\A`` as a letter.

Kept: ``type``, ``properties``, ``required``, ``additionalProperties``, ``patternProperties``,
``propertyNames``, ``min/maxProperties``, ``unevaluatedProperties``, ``items``,
``prefixItems``, ``unevaluatedItems``, ``min/maxItems``, ``enum``, ``const``, ``anyOf``,
``oneOf`` (proved), ``allOf`` of one, ``$ref`` into the document (``$defs``,
``definitions``, any JSON pointer), ``minimum``/``maximum``/``exclusive*``, ``min/maxLength``,
``pattern``, ``format`` in ``FORMATS``, and annotations (``title``, ``description``, …).
A keyword neither JSON Schema nor xgrammar knows is an annotation, as JSON Schema says.
Known narrowings (the output still follows the schema): a pattern must match the whole string,
and an object has no properties beyond those it declares unless ``additionalProperties`` or
``patternProperties`` allows them. Known widening: ``.`` in a pattern also matches a newline.

The walk is iterative and bounded (``MAX_NESTING`` JSON levels, ``MAX_DEPTH`` subschemas, each
``$ref`` target once); proving oneOfs disjoint builds each const/enum's set of values once,
proves each set of branches once, and spends at most ``MAX_ONEOF_WORK`` (values compared and
``$ref`` hops followed) in all; a regex is read in one pass (``regex_check``).
"""

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from services.gateway.regex_check import regex_problem

MAX_DEPTH = 48  # nested subschemas, from the root
MAX_REF_HOPS = 32  # a $ref to a $ref to …
MAX_DISCRIMINATORS = 16  # properties tried as a oneOf's discriminator
MAX_NESTING = 128  # JSON levels anywhere in the document (const and enum values too)
# const/enum values compared in proving oneOfs disjoint, over the whole schema: a branch's set
# of values is built once, but a schema could still ask for many comparisons of large sets
MAX_ONEOF_WORK = 1_000_000
INT64 = 2**63

FORMATS = frozenset({
    "email", "date", "date-time", "time", "duration", "uuid", "uri", "uri-reference",
    "uri-template", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer",
})  # fmt: skip
TYPES = frozenset({"null", "boolean", "object", "array", "number", "integer", "string"})
NEVER = {
    "not": "not", "if": "if/then/else", "then": "if/then/else", "else": "if/then/else",
    "dependentRequired": "dependentRequired", "dependentSchemas": "dependentSchemas",
    "dependencies": "dependencies", "contains": "contains", "minContains": "contains",
    "maxContains": "contains", "contentEncoding": "contentEncoding",
    "contentMediaType": "contentMediaType", "contentSchema": "contentSchema",
    "$dynamicRef": "$dynamicRef", "$recursiveRef": "$recursiveRef",
}  # fmt: skip
# the keywords xgrammar follows alone, in its order; every other constraint beside them is lost
LEADS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
STRING = ("minLength", "maxLength", "pattern", "format")
NUMBER = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
ARRAY = ("items", "prefixItems", "unevaluatedItems", "minItems", "maxItems")
OBJECT = ("properties", "required", "additionalProperties", "patternProperties",
          "propertyNames", "minProperties", "maxProperties", "unevaluatedProperties")  # fmt: skip
CONSTRAINTS = frozenset({"type", *LEADS, *STRING, *NUMBER, *ARRAY, *OBJECT, *NEVER,
                         "uniqueItems", "additionalItems"})  # fmt: skip

Path = tuple[str | int, ...]


class SchemaRefused(ValueError):
    """A schema the engine would not enforce as written: where (a path of keys and indices
    from the schema's root) and why."""

    def __init__(self, path: Path, message: str):
        super().__init__(message)
        self.path, self.message = path, message

    def where(self, prefix: str) -> str:
        """The path as a dotted parameter under ``prefix`` (``…schema.properties.a.pattern``)."""
        return ".".join([prefix, *map(str, self.path)])


@dataclass
class _Node:
    path: Path
    schema: Any
    default_type: str | None = None  # xgrammar reads propertyNames as a string's schema


_REF = object()  # a child that is a $ref's target (its path is the pointer's)


def serialize(schema: Any, path: Path = ()) -> str:
    """The schema as compact JSON text; a number JSON cannot carry (infinity) is refused."""
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        raise SchemaRefused(path, "the schema holds a number JSON cannot carry") from None


def check_schema(root: Any) -> None:
    """Raise ``SchemaRefused`` for the first part of ``root`` the engine would not enforce."""
    if not isinstance(root, dict | bool):
        raise SchemaRefused((), "a JSON schema is an object or a boolean")
    _check_nesting(root)
    todo, refs_seen, memo = [_Node((), root)], set[Path](), _Memo()
    while todo:
        node = todo.pop()
        if len(node.path) > MAX_DEPTH:
            raise SchemaRefused(node.path, f"the schema nests deeper than {MAX_DEPTH} levels")
        for child in _check(root, node, memo):
            if child.schema is _REF:  # a $ref target: checked once, wherever it is
                if child.path not in refs_seen:
                    refs_seen.add(child.path)
                    todo.append(_Node(child.path, _at(root, child.path), child.default_type))
            else:
                todo.append(child)


def _check_nesting(root: Any) -> None:
    """Refuse a document nested deeper than ``MAX_NESTING`` JSON levels anywhere (the helpers
    below that recurse into values, and ``serialize``, then stay far from Python's limit)."""
    todo = [(root, 1)]
    while todo:
        value, depth = todo.pop()
        children = value.values() if isinstance(value, dict) else value
        if isinstance(value, dict | list):
            if depth > MAX_NESTING:
                raise SchemaRefused((), f"the schema nests deeper than {MAX_NESTING} JSON levels")
            todo.extend((v, depth + 1) for v in children)


@dataclass
class _Memo:
    """One check's record for proving oneOfs disjoint: each const/enum's set of values (by
    its schema's identity), each proof (by the branches' identities), and the work spent."""

    values: dict[int, frozenset[str]] = field(default_factory=dict)
    proofs: dict[tuple[int, ...], bool] = field(default_factory=dict)
    work: int = 0


class _TooMuchWork(Exception):
    pass


def _check(root: Any, node: _Node, memo: _Memo) -> Iterator[_Node]:
    schema, path = node.schema, node.path
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise SchemaRefused(path, "a schema is an object or a boolean")
    for key, what in NEVER.items():
        if key in schema:
            raise SchemaRefused((*path, key), f"{what} is not supported: the grammar engine "
                                "(xgrammar) would not enforce it")  # fmt: skip
    if schema.get("uniqueItems") is True:
        raise SchemaRefused((*path, "uniqueItems"), "uniqueItems is not supported: the grammar "
                            "engine (xgrammar) would not enforce it")  # fmt: skip
    lead = next((k for k in LEADS if k in schema), None)
    if lead is not None:
        yield from _check_lead(root, schema, path, lead, memo)
        return
    types = _types(schema, path, node.default_type)
    if types is None:
        loose = next((k for k in (*STRING, *NUMBER, *ARRAY, *OBJECT) if k in schema), None)
        if loose is not None:
            raise SchemaRefused((*path, loose), f"{loose} without a type is not enforced (the "
                                'grammar engine allows any value there): add "type"')  # fmt: skip
        return
    if "string" in types:
        _check_string(schema, path)
    if types & {"integer", "number"}:
        _check_number(schema, path, types)
    if "array" in types:
        yield from _array_children(schema, path)
    if "object" in types:
        yield from _object_children(schema, path)


def _check_lead(root: Any, schema: dict, path: Path, lead: str, memo: _Memo) -> Iterator[_Node]:
    """A schema that xgrammar reads by ``lead`` alone: nothing else may constrain it."""
    others = [k for k in schema if k in CONSTRAINTS and k != lead]
    if lead in ("const", "enum") and "type" in others:
        others.remove("type")
        _values_have_type(schema, path, lead)
    if others:
        raise SchemaRefused((*path, others[0]), f"{others[0]} beside {lead} is not supported: "
                            f"the grammar engine follows {lead} alone and would ignore it "
                            f"(move it into {_into(lead)})")  # fmt: skip
    if lead == "$ref":
        yield _Node(_pointer(root, schema["$ref"], (*path, "$ref")), _REF)
    elif lead == "enum":
        if not isinstance(schema["enum"], list) or not schema["enum"]:
            raise SchemaRefused((*path, "enum"), "enum must be a non-empty array")
    elif lead in ("anyOf", "oneOf", "allOf"):
        branches = schema[lead]
        if not isinstance(branches, list) or not branches:
            raise SchemaRefused((*path, lead), f"{lead} must be a non-empty array of schemas")
        if lead == "allOf" and len(branches) > 1:
            raise SchemaRefused((*path, lead), "allOf of several schemas is not supported: the "
                                "grammar engine would let any value through (merge them into "
                                "one schema)")  # fmt: skip
        if lead == "oneOf" and len(branches) > 1 and not _proved(root, branches, path, memo):
            raise SchemaRefused((*path, lead), "oneOf whose branches may match the same value is "
                                "enforced as anyOf by the grammar engine: use anyOf, or make "
                                "the branches disjoint (different types, different const/enum "
                                "values, or a required property with a different const in "
                                "each)")  # fmt: skip
        yield from (_Node((*path, lead, i), b) for i, b in enumerate(branches))


def _into(lead: str) -> str:
    return {"$ref": "the referenced schema", "const": "nothing: const is one value",
            "enum": "nothing: enum lists the values"}.get(lead, f"each {lead} branch")  # fmt: skip


def _values_have_type(schema: dict, path: Path, lead: str) -> None:
    types = _types(schema, path, None) or TYPES
    values = [schema["const"]] if lead == "const" else schema["enum"]
    for i, value in enumerate(values if isinstance(values, list) else ()):
        if not any(_has_type(value, t) for t in types):
            where = (*path, lead) if lead == "const" else (*path, lead, i)
            raise SchemaRefused(where, f"{lead} value {json.dumps(value)[:40]} is not of the "
                                "schema's type (the grammar engine would allow it)")  # fmt: skip


def _types(schema: dict, path: Path, default: str | None) -> set[str] | None:
    """The types xgrammar generates for a schema: its ``type``, or the one its keywords imply
    (object, array), or ``default``; None: any value."""
    t = schema.get("type", default)
    if t is None:
        if any(k in schema for k in ("properties", "additionalProperties",
                                     "unevaluatedProperties")):  # fmt: skip
            return {"object"}
        if any(k in schema for k in ("items", "prefixItems", "unevaluatedItems")):
            return {"array"}
        return None
    names = t if isinstance(t, list) else [t]
    if not names or not all(isinstance(n, str) and n in TYPES for n in names):
        raise SchemaRefused((*path, "type"), f"type must be one of {', '.join(sorted(TYPES))} "
                            "or a non-empty array of them")  # fmt: skip
    return set(names)


def _check_string(schema: dict, path: Path) -> None:
    shaped = next((k for k in ("format", "pattern") if k in schema), None)
    if shaped is not None:
        length = next((k for k in ("minLength", "maxLength") if k in schema), None)
        if length is not None:
            raise SchemaRefused((*path, length), f"{length} beside {shaped} is not supported: "
                                "the grammar engine (xgrammar) would ignore it (write the "
                                "length into the pattern, e.g. ^[a-z]{3,10}$)")  # fmt: skip
    if "format" in schema:
        if "pattern" in schema:
            raise SchemaRefused((*path, "pattern"), "pattern beside format is not supported: the "
                                "grammar engine would follow the format alone")  # fmt: skip
        if not isinstance(schema["format"], str) or schema["format"] not in FORMATS:
            known = ", ".join(sorted(FORMATS))
            raise SchemaRefused((*path, "format"), f"format {str(schema['format'])[:40]!r} is "
                                f"not supported; these are: {known}")  # fmt: skip
    if "pattern" in schema:
        _check_regex(schema["pattern"], (*path, "pattern"))


def _check_number(schema: dict, path: Path, types: set[str]) -> None:
    step = schema.get("multipleOf")
    if step is not None:
        if "number" in types:
            raise SchemaRefused((*path, "multipleOf"), "multipleOf on numbers is not "
                                "supported (only on integers): the grammar engine would ignore "
                                "it")  # fmt: skip
        if not (_is_number(step) and step == int(step) and 0 < step <= 1024):
            raise SchemaRefused((*path, "multipleOf"), "multipleOf on integers must be a "
                                "whole number from 1 to 1024 (the grammar engine ignores "
                                "others)")  # fmt: skip
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        bound = schema.get(key)
        if bound is None:
            continue
        if not _is_number(bound):
            raise SchemaRefused((*path, key), f"{key} must be a number")
        whole = bound == int(bound) and -INT64 < bound < INT64
        if "integer" in types and "number" not in types and not whole:
            raise SchemaRefused((*path, key), f"{key} of an integer must be a whole number "
                                "within 64 bits")  # fmt: skip


def _array_children(schema: dict, path: Path) -> Iterator[_Node]:
    items = schema.get("items")
    if isinstance(items, list):
        raise SchemaRefused((*path, "items"), "items as an array (draft 4 tuples) is not "
                            "supported: use prefixItems")  # fmt: skip
    prefix = schema.get("prefixItems", [])
    if not isinstance(prefix, list):
        raise SchemaRefused((*path, "prefixItems"), "prefixItems must be an array of schemas")
    yield from (_Node((*path, "prefixItems", i), s) for i, s in enumerate(prefix))
    for key in ("items", "unevaluatedItems"):
        if key in schema:
            yield _Node((*path, key), schema[key])


def _object_children(schema: dict, path: Path) -> Iterator[_Node]:
    properties = schema.get("properties", {})
    if not isinstance(properties, dict):
        raise SchemaRefused((*path, "properties"), "properties must be an object of schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaRefused((*path, "required"), "required must be an array of names")
    for i, name in enumerate(required):
        if name not in properties:
            raise SchemaRefused((*path, "required", i), f"required property {name[:40]!r} is "
                                "not in properties: the grammar engine would not enforce it "
                                "(declare its schema in properties)")  # fmt: skip
    if "propertyNames" in schema and properties:
        raise SchemaRefused((*path, "propertyNames"), "propertyNames beside properties is not "
                            "supported: the grammar engine does not check the declared "
                            "names against it")  # fmt: skip
    patterns = schema.get("patternProperties", {})
    if not isinstance(patterns, dict):
        raise SchemaRefused((*path, "patternProperties"), "patternProperties must be an object")
    for name, sub in properties.items():
        yield _Node((*path, "properties", name), sub)
    for regex, sub in patterns.items():
        _check_regex(regex, (*path, "patternProperties", regex))
        yield _Node((*path, "patternProperties", regex), sub)
    for key in ("additionalProperties", "unevaluatedProperties"):
        if key in schema:
            yield _Node((*path, key), schema[key])
    if "propertyNames" in schema:
        yield _Node((*path, "propertyNames"), schema["propertyNames"], "string")


def _check_regex(pattern: Any, path: Path) -> None:
    if not isinstance(pattern, str):
        raise SchemaRefused(path, "a pattern is a string")
    problem = regex_problem(pattern)
    if problem is not None:
        raise SchemaRefused(path, problem)


def _pointer(root: Any, ref: Any, path: Path) -> Path:
    """The path of a local ``$ref``'s target ("#", "#/$defs/a", "#/properties/x/items")."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise SchemaRefused(path, "only a $ref into this schema is supported ('#' or '#/…'; no "
                            "other document, no $anchor)")  # fmt: skip
    keys: list[str | int] = []
    node = root
    for raw in ref[2:].split("/") if ref != "#" else ():
        key = unquote(raw).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            keys.append(key)
            node = node[key]
        elif isinstance(node, list) and key.isascii() and key.isdigit() and len(key) < 10 and (
            int(key) < len(node)):  # fmt: skip
            keys.append(int(key))
            node = node[int(key)]
        else:
            raise SchemaRefused(path, f"$ref {ref[:60]!r} points to nothing in this schema")
    if not isinstance(node, dict | bool):
        raise SchemaRefused(path, f"$ref {ref[:60]!r} does not point to a schema")
    return tuple(keys)


def _at(root: Any, path: Path) -> Any:
    node = root
    for key in path:
        node = node[key]
    return node


# ---- oneOf: may two branches match one value? ------------------------------------------------


def _proved(root: Any, branches: list, path: Path, memo: _Memo) -> bool:
    """``_disjoint``, once for each set of branches, within the schema's ``MAX_ONEOF_WORK``."""
    try:
        resolved = [_resolve(root, b, memo) for b in branches]
        key = tuple(map(id, resolved))
        if key not in memo.proofs:
            memo.proofs[key] = _disjoint(root, resolved, memo)
    except _TooMuchWork:
        raise SchemaRefused((*path, "oneOf"), "the schema's oneOf branches are too many or "
                            "too large to prove disjoint: use anyOf") from None  # fmt: skip
    return memo.proofs[key]


def _disjoint(root: Any, resolved: list, memo: _Memo) -> bool:
    """True when no value can match two of the ``resolved`` branches (then anyOf enforces the
    oneOf)."""
    return _by_type_or_value(resolved, memo) or _by_discriminator(root, resolved, memo)


def _resolve(root: Any, schema: Any, memo: "_Memo") -> Any:
    """The schema a chain of ``$ref`` ends at (None: too long, or nowhere), each hop counted
    as work by the length of its pointer."""
    for _ in range(MAX_REF_HOPS):
        if not (isinstance(schema, dict) and "$ref" in schema):
            return schema
        memo.work += 1 + len(str(schema["$ref"]))
        if memo.work > MAX_ONEOF_WORK:
            raise _TooMuchWork
        try:
            schema = _at(root, _pointer(root, schema["$ref"], ()))
        except SchemaRefused:
            return None
    return None


def _by_type_or_value(branches: list, memo: _Memo) -> bool:
    """Each branch a set of values (const/enum) or of types, none shared (integers are
    numbers)."""
    types: set[str] = set()  # of the typed branches
    value_types: set[str] = set()  # of the values of the finite ones
    values: set[str] = set()
    for b in branches:
        finite = _finite(b)
        if finite is not None:
            keys = _value_keys(b, finite, memo)
            kinds = {_kind(v) for v in finite}
            if keys & values or kinds & types:
                return False
            values |= keys
            value_types |= kinds
            continue
        if not isinstance(b, dict) or any(k in b for k in LEADS) or "type" not in b:
            return False
        t = b["type"] if isinstance(b["type"], list) else [b["type"]]
        kinds = {"number" if k == "integer" else str(k) for k in t}
        if kinds & types or kinds & value_types:
            return False
        types |= kinds
    return True


def _by_discriminator(root: Any, branches: list, memo: _Memo) -> bool:
    """Objects that all require one property whose const/enum values differ between them."""
    first = branches[0]
    if not isinstance(first, dict) or not isinstance(first.get("required"), list):
        return False
    keys = [k for k in first["required"] if isinstance(k, str)]
    for key in keys[:MAX_DISCRIMINATORS]:
        seen: set[str] = set()
        for b in branches:
            values = _tag_values(root, b, key, memo)
            if values is None or values & seen:
                break
            seen |= values
        else:
            return True
    return False


def _tag_values(root: Any, branch: Any, key: str, memo: _Memo) -> frozenset[str] | None:
    if not (isinstance(branch, dict) and branch.get("type") == "object"):
        return None
    properties, required = branch.get("properties"), branch.get("required")
    if not (isinstance(properties, dict) and isinstance(required, list) and key in required):
        return None
    tag = _resolve(root, properties.get(key), memo)
    finite = _finite(tag)
    return None if finite is None else _value_keys(tag, finite, memo)


def _value_keys(schema: dict, finite: list, memo: _Memo) -> frozenset[str]:
    """The canonical keys of ``finite``, the values of ``schema``'s const or enum, made once a
    schema (a part of the document, alive while it is checked); each use counts its values as
    work (a proof compares them)."""
    memo.work += len(finite)
    if memo.work > MAX_ONEOF_WORK:
        raise _TooMuchWork
    keys = memo.values.get(id(schema))
    if keys is None:
        keys = memo.values[id(schema)] = frozenset(_canonical(v) for v in finite)
    return keys


def _finite(schema: Any) -> list | None:
    if not isinstance(schema, dict) or "$ref" in schema:
        return None
    if "const" in schema:
        return [schema["const"]]
    enum = schema.get("enum")
    return enum if isinstance(enum, list) and enum else None


def _canonical(value: Any) -> str:
    """One key for equal JSON values (1 and 1.0 alike; true is not 1)."""
    return json.dumps(_plain(value), sort_keys=True)


def _plain(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        try:
            return float(value)
        except OverflowError:
            return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return str(value)


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    return {str: "string", type(None): "null", list: "array", dict: "object"}.get(
        type(value), "other"
    )


def _has_type(value: Any, t: str) -> bool:
    if t == "integer":
        return _is_number(value) and value == int(value)
    return _kind(value) == t


def _is_number(value: Any) -> bool:
    """A finite JSON number (not a boolean)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return isinstance(value, int) or math.isfinite(value)
