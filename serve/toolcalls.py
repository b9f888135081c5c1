"""Tool calls constrained to the Qwen3.5 XML call format, built from each tool's JSON Schema.

Qwen3.5 writes a call as

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

and vLLM's `qwen3_coder` parser reads VALUE as the text between the parameter tags less one
wrapping newline, then converts it to the type the schema gives (a string stays raw text, other
types are read as JSON). vLLM asks a structural-tag builder for the grammar of a request's calls;
`install()` registers `build()` as that builder for the `qwen_3_coder` format (the API server calls
it at start-up), so that:

- a forced call (`tool_choice` naming a function) is exactly one call of that function, and
  `required` is one or more calls and nothing else: at most the server's `max_tool_calls` for a
  chat request that went through our middleware (which sets `CALL_LIMIT`; one with
  `parallel_tool_calls: false`), so that a reply always ends (a random-weight model would chain
  calls until `max_tokens`);
- each call's parameters follow the schema: every required key, in the schema's order, optional
  ones may be left out, no others; enums and consts are spelled exactly; strings are raw text
  between `minLength` and `maxLength` characters (whole UTF-8 characters; a bounded string has no
  '<'; `STRING_MAX_CHARS` bounds the strings whose schema does not, when the server sets it) that
  cannot contain the markup that would end the parameter early; numbers, booleans,
  nulls, arrays and objects are JSON (at most one whitespace in a row) against their sub-schema,
  `$defs` included;
- the markup between parameters is exactly the template's, so the parsed value is the generated
  one (a free whitespace would become part of a string).

A forced or `required` call is constrained this way whatever the tool's `strict` flag says; under
`tool_choice: auto` a call is constrained when vLLM's tool strictness asks for it.
"""

from __future__ import annotations

import copy
from contextvars import ContextVar
from typing import Any

CALL_BEGIN = "<tool_call>\n<function={name}>\n"
CALL_END = "</function>\n</tool_call>"
TRIGGER = "<tool_call>\n<function="
PARAM_BEGIN = "<parameter={name}>\n"
PARAM_END = "\n</parameter>\n"
CALL_SEPARATOR = "\n"
MAX_WHITESPACE = 1
"""Whitespace characters in a row inside JSON values (a random-weight model pads forever otherwise)."""
TEXT_EXCLUDES = ["</parameter>", "<parameter=", "</function>", "<function=", "<tool_call>", "</tool_call>"]
"""Markup a string value cannot contain: vLLM's parser would end the parameter (or the call) there."""
THINK_EXCLUDES = ["<think>", "</think>"]
FORMAT_NAME = "qwen_3_coder"
STRING_MAX_CHARS: int | None = None
"""Longest string of a constrained call where the schema gives no maxLength (None: no limit); set by
`install` from the server's `tool_string_max_chars`."""
CALL_LIMIT: ContextVar[int | None] = ContextVar("qwen35_tool_call_limit", default=None)
"""Calls the request being served may make (set by the middleware around the request; None: no
limit but vLLM's own `parallel_tool_calls` handling)."""


def _formats():
    from xgrammar import structural_tag as st

    return st


def _types(schema: dict) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return set()


def _raw_text(value: object) -> str:
    """How a value is spelled between the parameter tags (strings raw, the rest as JSON)."""
    import json

    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _string_format(schema: dict):
    """Raw text for a string: its `pattern` when it has one; with a `maxLength` (or the server's
    `STRING_MAX_CHARS`), whole UTF-8 characters other than '<' (so a bounded string cannot open
    markup, and its length is exact); without one, any text free of the parameter and call markup."""
    st = _formats()
    low = schema.get("minLength") if isinstance(schema.get("minLength"), int) else 0
    high = schema.get("maxLength") if isinstance(schema.get("maxLength"), int) else STRING_MAX_CHARS
    if high is not None:
        high = max(high, low)
    if isinstance(schema.get("pattern"), str):
        return st.RegexFormat(pattern=schema["pattern"])
    if high is not None:
        return st.RegexFormat(pattern=f"[^<]{{{max(0, low)},{max(0, high)}}}")
    if low > 0:
        return st.SequenceFormat(elements=[st.RegexFormat(pattern=f"[^<]{{{low}}}"),
                                           st.AnyTextFormat(excludes=TEXT_EXCLUDES)])  # fmt: skip
    return st.AnyTextFormat(excludes=TEXT_EXCLUDES)


def value_format(schema: object, defs: dict):
    """The format of one parameter's VALUE text for its sub-schema."""
    st = _formats()
    if not isinstance(schema, dict) or schema is True:
        return st.AnyTextFormat(excludes=TEXT_EXCLUDES)
    if "const" in schema:
        return st.ConstStringFormat(value=_raw_text(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        options = [st.ConstStringFormat(value=_raw_text(v)) for v in schema["enum"]]
        return options[0] if len(options) == 1 else st.OrFormat(elements=options)
    kinds = _types(schema)
    if kinds == {"string"}:
        return _string_format(schema)
    if kinds == {"null"}:
        return st.ConstStringFormat(value="null")
    json_schema = {**schema, **defs}
    if "string" in kinds:  # a string or something else: raw text, or JSON for the other types
        others = {**json_schema, "type": sorted(kinds - {"string"})}
        return st.OrFormat(elements=[_string_format(schema), _json(others)])
    return _json(json_schema)


def _json(schema: dict):
    return _formats().JSONSchemaFormat(json_schema=schema, style="json", max_whitespace_cnt=MAX_WHITESPACE)


def _parameters_format(parameters: object):
    """The parameter tags of one call, or None when the schema needs xgrammar's general XML form."""
    st = _formats()
    if parameters is None or parameters is True or parameters == {}:
        return st.ConstStringFormat(value="")
    if not isinstance(parameters, dict):
        return None
    properties = parameters.get("properties") or {}
    required = [k for k in parameters.get("required") or [] if isinstance(k, str)]
    general = ("patternProperties", "anyOf", "oneOf", "allOf", "$ref", "if", "dependentRequired", "minProperties")
    if not isinstance(properties, dict) or any(k in parameters for k in general) or set(required) - set(properties):
        return None
    defs = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    elements = []
    for key, sub in properties.items():
        one = st.SequenceFormat(elements=[st.ConstStringFormat(value=PARAM_BEGIN.format(name=key)),
                                          value_format(sub, defs), st.ConstStringFormat(value=PARAM_END)])  # fmt: skip
        elements.append(one if key in required else st.OptionalFormat(content=one))
    if not elements:
        return st.ConstStringFormat(value="")
    return elements[0] if len(elements) == 1 else st.SequenceFormat(elements=elements)


def call_format(name: str, parameters: object):
    """One call of function `name` whose arguments follow `parameters` (a JSON Schema)."""
    st = _formats()
    content = _parameters_format(copy.deepcopy(parameters))
    if content is None:  # a schema beyond the parameter list: xgrammar's own Qwen XML form
        content = st.SequenceFormat(elements=[
            st.JSONSchemaFormat(json_schema=parameters, style="qwen_xml", max_whitespace_cnt=MAX_WHITESPACE),
            st.ConstStringFormat(value="\n"),
        ])  # fmt: skip
    return st.TagFormat(begin=CALL_BEGIN.format(name=name), content=content, end=CALL_END)


def _parameters_of(function: Any, forced: bool) -> object:
    """The schema a call's arguments follow: always the tool's for forced and required calls; for
    auto calls only when vLLM pinned the tool as strict (else any arguments)."""
    parameters = getattr(function, "parameters", None)
    if not forced and getattr(function, "strict", None) is False:
        return True
    return parameters if parameters is not None else {}


def build(tools: list, builtin_tools: list, tool_choice: str, reasoning: bool, token_suffix: str = ""):
    """vLLM's structural-tag builder interface: (function tools, builtin tools, "auto" | "required" |
    "forced", reasoning, token suffix) -> xgrammar StructuralTag."""
    del builtin_tools, reasoning, token_suffix  # Qwen3.5 has no builtin tools; vLLM asks after the reasoning
    st = _formats()
    forced = tool_choice in ("forced", "required")
    tags = [call_format(tool.function.name, _parameters_of(tool.function, forced)) for tool in tools]
    if tool_choice == "auto":
        body = (st.TriggeredTagsFormat(triggers=[TRIGGER], tags=tags, excludes=THINK_EXCLUDES) if tags
                else st.AnyTextFormat(excludes=THINK_EXCLUDES))  # fmt: skip
    else:
        if not tags:
            raise ValueError(f"tool_choice {tool_choice!r} needs at least one function tool")
        limit = 1 if tool_choice == "forced" else CALL_LIMIT.get()
        if limit is None:
            body = st.TagsWithSeparatorFormat(tags=tags, separator=CALL_SEPARATOR, at_least_one=True)
        else:
            one = tags[0] if len(tags) == 1 else st.OrFormat(elements=tags)
            more = st.SequenceFormat(elements=[st.ConstStringFormat(value=CALL_SEPARATOR), one])
            tail = st.RepeatFormat(min=0, max=limit - 1, content=more)
            body = one if limit <= 1 else st.SequenceFormat(elements=[one, tail])
    return st.StructuralTag(format=body)


def install(string_max_chars: int | None = None) -> bool:
    """Register `build` as vLLM's structural-tag builder for the Qwen3 XML call format, with the
    server's cap on unbounded strings; False when this vLLM has no such registry (then its own
    builder stays)."""
    global STRING_MAX_CHARS
    try:
        from vllm.tool_parsers.structural_tag_registry import register_vllm_structural_tag
    except ImportError:
        return False
    STRING_MAX_CHARS = string_max_chars
    register_vllm_structural_tag(FORMAT_NAME)(build)
    return True
