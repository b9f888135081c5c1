"""JSON judgements the checks need without extra dependencies.

- `json_prefix_state(text)`: is `text` a complete JSON document, a valid *prefix* of one (what a
  grammar-constrained reply cut by `max_tokens` looks like), or invalid;
- `schema_errors(value, schema)`: the subset of JSON Schema the suite's own schemas use (type,
  enum, const, properties, required, additionalProperties false, items, pattern, length and range
  bounds).
"""

from __future__ import annotations

import re
from typing import Any

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(0|[1-9][0-9]*)?(\.[0-9]*)?([eE][+-]?[0-9]*)?")


class _EndOfInput(Exception):
    """The text ended where more JSON could follow."""


class _PrefixParser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def peek(self) -> str:
        if self.pos >= len(self.text):
            raise _EndOfInput
        return self.text[self.pos]

    def take(self) -> str:
        char = self.peek()
        self.pos += 1
        return char

    def skip_ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1

    def value(self) -> None:
        self.skip_ws()
        char = self.peek()
        if char == "{":
            self.members("}", keyed=True)
        elif char == "[":
            self.members("]", keyed=False)
        elif char == '"':
            self.string()
        elif char == "-" or char.isdigit():
            self.number()
        else:
            self.literal()

    def members(self, close: str, keyed: bool) -> None:
        self.pos += 1
        self.skip_ws()
        if self.peek() == close:
            self.pos += 1
            return
        while True:
            if keyed:
                self.skip_ws()
                if self.peek() != '"':
                    raise ValueError(f"expected a key at offset {self.pos}")
                self.string()
                self.skip_ws()
                if self.take() != ":":
                    raise ValueError(f"expected ':' at offset {self.pos - 1}")
            self.value()
            self.skip_ws()
            char = self.take()
            if char == close:
                return
            if char != ",":
                raise ValueError(f"expected ',' or {close!r} at offset {self.pos - 1}")

    def string(self) -> None:
        self.pos += 1
        while True:
            char = self.take()
            if char == '"':
                return
            if char == "\\":
                escape = self.take()
                if escape == "u":
                    for _ in range(4):
                        if self.take() not in "0123456789abcdefABCDEF":
                            raise ValueError(f"bad \\u escape at offset {self.pos - 1}")
                elif escape not in '"\\/bfnrt':
                    raise ValueError(f"bad escape at offset {self.pos - 1}")
            elif ord(char) < 0x20:
                raise ValueError(f"control character in string at offset {self.pos - 1}")

    def number(self) -> None:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in "+-0123456789.eE":
            self.pos += 1
        token = self.text[start : self.pos]
        if self.pos == len(self.text) and _NUMBER_PREFIX.fullmatch(token):
            if _NUMBER.fullmatch(token):
                return
            raise _EndOfInput
        if not _NUMBER.fullmatch(token):
            raise ValueError(f"bad number {token!r} at offset {start}")

    def literal(self) -> None:
        rest = self.text[self.pos : self.pos + 5]
        for word in ("true", "false", "null"):
            if rest.startswith(word):
                self.pos += len(word)
                return
            if word.startswith(rest) and self.pos + len(rest) == len(self.text):
                raise _EndOfInput
        raise ValueError(f"unexpected {rest[:1]!r} at offset {self.pos}")


def json_prefix_state(text: str) -> str:
    """`"complete"` (one JSON document, optional surrounding whitespace), `"prefix"` (text ends
    inside a document that could still be completed) or `"invalid"`."""
    parser = _PrefixParser(text)
    try:
        parser.value()
    except _EndOfInput:
        return "prefix"
    except ValueError:
        return "invalid"
    parser.skip_ws()
    return "complete" if parser.pos == len(text) else "invalid"


_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def _is_type(value: Any, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _TYPES[name])


def schema_errors(value: Any, schema: dict, path: str = "$") -> list[str]:
    """Every way `value` breaks `schema`, each as `"<json path>: <what is wrong>"`."""
    errors: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, name) for name in names):
            return [f"{path}: expected type {types}, got {type(value).__name__} {value!r:.60}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r:.60} not in enum {schema['enum']}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: expected const {schema['const']!r}, got {value!r:.60}")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)):
            errors.append(f"{path}: length {len(value)} > maxLength {schema['maxLength']}")
        if len(value) < schema.get("minLength", 0):
            errors.append(f"{path}: length {len(value)} < minLength {schema['minLength']}")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{path}: {value!r:.60} does not match pattern {schema['pattern']!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            errors.append(f"{path}: {value} < minimum {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            errors.append(f"{path}: {value} > maximum {schema['maximum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path}.{name}: required property missing")
        for name, item in value.items():
            if name in properties:
                errors.extend(schema_errors(item, properties[name], f"{path}.{name}"))
            elif schema.get("additionalProperties") is False:
                errors.append(f"{path}.{name}: property not allowed (additionalProperties is false)")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{path}: {len(value)} items < minItems {schema['minItems']}")
        if len(value) > schema.get("maxItems", len(value)):
            errors.append(f"{path}: {len(value)} items > maxItems {schema['maxItems']}")
        if isinstance(schema.get("items"), dict):
            for index, item in enumerate(value):
                errors.extend(schema_errors(item, schema["items"], f"{path}[{index}]"))
    return errors
