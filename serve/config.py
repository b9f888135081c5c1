"""`qwen35-serve`'s configuration: a YAML mapping whose keys mirror vLLM's server options.

A config file sets any field of `ServeConfig` (vLLM's own option names with underscores, plus a
few of ours); `null` means "vLLM's default". Unknown keys and values of the wrong type are errors
that name the key, the value and what was expected, so a typo never silently becomes a default:

    model: /models/Qwen3.5-27B          # omitted or null: the embedded tiny checkpoint
    tensor_parallel_size: 4
    max_model_len: 32768
    max_n: 8                            # one of ours: larger n is answered 400
    api_key_file: /run/secrets/qwen35   # one of ours: the accepted key(s), one per line

`ServeConfig` is a pydantic model and the one declaration of every key: its type, bounds,
documentation and how it reaches vLLM (`Style`). Values are validated strictly: YAML `'4'` is not
the integer 4, `1` is not `true`. `OPTIONS` lists the keys for the command line and the docs.

Settings are resolved in layers, each only filling keys that a later one leaves unset:
vLLM's defaults < `QWEN35_DEFAULTS` < host defaults (`qwen35-serve` adds the embedded model's and a
CPU host's) < the config file < command-line overrides. `vllm_argv()` turns the result into the
argument list vLLM's own parser reads, so vLLM still does the value conversion it always does.

This module imports neither vLLM nor torch: a config is checked in milliseconds.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError


class ConfigError(ValueError):
    """A configuration that cannot be served: the message names the key and what was expected."""


class Style:
    """How a value reaches vLLM's argument parser."""

    PLAIN = "plain"  # --name VALUE
    FLAG = "flag"  # --name / --no-name
    STORE_TRUE = "store_true"  # --name when true, nothing when false
    NARGS = "nargs"  # --name V1 V2 ...
    APPEND = "append"  # --name V1 --name V2 ...
    JSON = "json"  # --name '<json>'
    OURS = "ours"  # read by qwen35-serve itself, never passed to vLLM


PLAIN, FLAG, STORE_TRUE, NARGS, APPEND, JSON, OURS = (Style.PLAIN, Style.FLAG, Style.STORE_TRUE, Style.NARGS,
                                                       Style.APPEND, Style.JSON, Style.OURS)  # fmt: skip


@dataclass(frozen=True)
class Kind:
    """A value type as messages and the command line name it (kept in the type's metadata)."""

    name: str
    text: str


INT, NUMBER, BOOL, STR = Kind("int", "an integer"), Kind("number", "a number"), Kind("bool", "true or false"), Kind(
    "str", "a string")  # fmt: skip
SIZE = Kind("size", "an integer or a size string such as '32k' or '4G'")
STRS = Kind("strs", "a string or a list of strings")
MAPPING = Kind("mapping", "a mapping")
STR_LIST = Kind("str_list", "a list of strings")

Int = Annotated[int, INT]
Number = Annotated[float, NUMBER, Field(allow_inf_nan=False)]
Bool = Annotated[bool, BOOL]
Str = Annotated[str, STR]
Size = Annotated[int | str, SIZE]
Strs = Annotated[str | list[str], STRS]
Mapping_ = Annotated[dict[str, Any], MAPPING]
StrList = Annotated[list[str], STR_LIST]

VLLM = "vLLM option"


def opt(style: str, help: str = VLLM, **bounds: float) -> Any:
    """A config key: unset (null) by default, documented by `help`, passed to vLLM as `style`."""
    return Field(default=None, description=help, json_schema_extra={"style": style}, **bounds)


class ServeConfig(BaseModel):
    """Every key a config file or a command-line override may set (null: unset)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # -- ours ------------------------------------------------------------------------------------
    max_n: Int | None = opt(OURS, "largest `n` a request may ask for (more is answered 400)", ge=1, le=16384)
    thinking_off_with_tools: Bool | None = opt(
        OURS, "turn thinking off for requests that offer tools with tool_choice auto, unless they ask for it"
    )
    text_only: Bool | None = opt(
        OURS, "refuse image/audio/video parts with a clear 400 (null: when the served model takes no media)"
    )
    max_request_bytes: Int | None = opt(OURS, "largest request body accepted (more is answered 413)", ge=1024)
    api_key_file: Str | None = opt(
        OURS,
        "file holding the accepted API key(s), one per line ('#' comments and blank lines skipped); a "
        "relative path is read from the config file's folder",
    )
    admin_routes: Bool | None = opt(
        OURS,
        "serve vLLM's admin and state-changing routes (scaling, sleep/wake, cache resets, collective RPC, "
        "LoRA loading, profiling, weight updates), behind the API key (needs one); false: they answer 404",
    )
    public_metrics: Bool | None = opt(
        OURS, "/metrics answers without the API key (false: it needs the key like every other route)"
    )
    max_tool_calls: Int | None = opt(
        OURS, "most tool calls one reply to tool_choice required may hold (parallel_tool_calls false: one)", ge=1
    )
    tool_string_max_chars: Int | None = opt(
        OURS,
        "longest string a forced or required tool call may write where the tool's schema gives no maxLength "
        "(null: no limit; the embedded random-weight model never ends a string on its own)",
        ge=1,
    )
    fetch_images: Bool | None = opt(
        OURS,
        "fetch the http(s) image URLs that requests name (our middleware fetches, checks and inlines them; only "
        "the hosts of allowed_media_domains when that is set); false: such requests are answered 400 and vLLM "
        "is kept from fetching any URL (send images as data: URLs)",
    )
    max_image_bytes: Int | None = opt(OURS, "largest encoded image a request may hold or fetch (more is answered "
                                            "400)", ge=1024)  # fmt: skip
    max_image_pixels: Int | None = opt(OURS, "most pixels (width x height, read from the image's header) an image "
                                             "may have (more is answered 400)", ge=1)  # fmt: skip
    vllm_args: StrList | None = opt(OURS, "extra vLLM command-line arguments, appended verbatim")
    # -- model -----------------------------------------------------------------------------------
    model: Str | None = opt(PLAIN, "checkpoint directory or hub id (null: the embedded tiny Qwen3.5 checkpoint)")
    tokenizer: Str | None = opt(PLAIN)
    revision: Str | None = opt(PLAIN)
    dtype: Str | None = opt(PLAIN)
    kv_cache_dtype: Str | None = opt(PLAIN)
    quantization: Str | None = opt(PLAIN)
    chat_template: Str | None = opt(PLAIN)
    generation_config: Str | None = opt(PLAIN)
    load_format: Str | None = opt(PLAIN)
    download_dir: Str | None = opt(PLAIN)
    chat_template_content_format: Str | None = opt(PLAIN)
    mamba_cache_mode: Str | None = opt(PLAIN)
    mamba_ssm_cache_dtype: Str | None = opt(PLAIN)
    reasoning_parser: Str | None = opt(PLAIN)
    tool_call_parser: Str | None = opt(PLAIN)
    tool_strict_level: Str | None = opt(
        PLAIN,
        "vLLM option: how far tool calls are constrained: auto, function (the call's markup and name) or "
        "parameter (the arguments too, against each tool's JSON schema)",
    )
    distributed_executor_backend: Str | None = opt(PLAIN)
    seed: Int | None = opt(PLAIN)
    max_model_len: Size | None = opt(PLAIN, "vLLM option: context length (tokens; '32k' and 'auto' work too)")
    trust_remote_code: Bool | None = opt(FLAG)
    language_model_only: Bool | None = opt(FLAG)
    hf_overrides: Mapping_ | None = opt(JSON)
    override_generation_config: Mapping_ | None = opt(JSON)
    limit_mm_per_prompt: Mapping_ | None = opt(
        JSON, "vLLM option: most items of each medium one prompt may hold ({image: 16}; more is answered 400)"
    )
    allowed_media_domains: StrList | None = opt(NARGS, "vLLM option: the only hosts media URLs may be fetched from")
    # -- server ----------------------------------------------------------------------------------
    host: Str | None = opt(PLAIN, "vLLM option: address to bind")
    port: Int | None = opt(PLAIN, "vLLM option: port to bind", ge=1, le=65535)
    api_key: Strs | None = opt(
        NARGS,
        "vLLM option: accepted bearer key(s); better kept out of files and command lines (api_key_file, VLLM_API_KEY)",
    )
    served_model_name: Strs | None = opt(NARGS, "vLLM option: model name(s) the API answers to")
    middleware: Strs | None = opt(APPEND, "vLLM option: extra ASGI middleware import paths (ours is always added)")
    allowed_origins: StrList | None = opt(JSON, "vLLM option: CORS origins")
    uvicorn_log_level: Str | None = opt(PLAIN)
    root_path: Str | None = opt(PLAIN)
    ssl_keyfile: Str | None = opt(PLAIN)
    ssl_certfile: Str | None = opt(PLAIN)
    api_server_count: Int | None = opt(PLAIN, ge=1)
    disable_uvicorn_access_log: Bool | None = opt(FLAG)
    enable_log_requests: Bool | None = opt(FLAG)
    disable_fastapi_docs: Bool | None = opt(FLAG)
    enable_prompt_tokens_details: Bool | None = opt(FLAG)
    enable_force_include_usage: Bool | None = opt(FLAG)
    enable_auto_tool_choice: Bool | None = opt(FLAG)
    return_tokens_as_token_ids: Bool | None = opt(FLAG)
    disable_log_stats: Bool | None = opt(STORE_TRUE)
    max_logprobs: Int | None = opt(PLAIN, ge=0)
    structured_outputs_config: Mapping_ | None = opt(JSON)
    default_chat_template_kwargs: Mapping_ | None = opt(
        JSON,
        "vLLM option: chat template arguments every request starts from ({enable_thinking: false} turns "
        "thinking off unless a request asks for it)",
    )
    # -- engine ----------------------------------------------------------------------------------
    gpu_memory_utilization: Number | None = opt(PLAIN, "vLLM option: share of accelerator memory to use",
                                                ge=0.01, le=1.0)  # fmt: skip
    kv_cache_memory_bytes: Size | None = opt(PLAIN, "vLLM option: KV cache size instead of a memory share ('4G')")
    max_num_seqs: Int | None = opt(PLAIN, "vLLM option: requests scheduled together, at most", ge=1)
    tensor_parallel_size: Int | None = opt(PLAIN, ge=1)
    pipeline_parallel_size: Int | None = opt(PLAIN, ge=1)
    data_parallel_size: Int | None = opt(PLAIN, ge=1)
    block_size: Int | None = opt(PLAIN, ge=1)
    max_cudagraph_capture_size: Int | None = opt(PLAIN, ge=1)
    max_num_batched_tokens: Size | None = opt(PLAIN, "vLLM option: tokens one engine step computes, at most")
    long_prefill_token_threshold: Int | None = opt(
        PLAIN, "vLLM option: prompt tokens one request may prefill in a step while others run (0: no cap)", ge=0
    )
    cpu_offload_gb: Number | None = opt(PLAIN, ge=0)
    enforce_eager: Bool | None = opt(FLAG)
    enable_prefix_caching: Bool | None = opt(FLAG)
    enable_chunked_prefill: Bool | None = opt(FLAG)
    enable_expert_parallel: Bool | None = opt(FLAG)
    async_scheduling: Bool | None = opt(FLAG)
    compilation_config: Mapping_ | None = opt(JSON)
    speculative_config: Mapping_ | None = opt(JSON)


@dataclass(frozen=True)
class Option:
    """One key of `ServeConfig`, as the command line and the argument builder read it."""

    name: str
    kind: Kind
    style: str
    help: str
    low: float | None = None  # inclusive bounds for numbers
    high: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def expected(self) -> str:
        if self.low is None and self.high is None:
            return self.kind.text
        if self.high is None:
            return f"{self.kind.text} >= {self.low:g}"
        return f"{self.kind.text} in [{self.low:g}, {self.high:g}]"


def _option(name: str, info: Any) -> Option:
    kinds = [m for m in info.metadata if isinstance(m, Kind)]
    low = next((m.ge for m in info.metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in info.metadata if isinstance(m, annotated_types.Le)), None)
    args = getattr(info.annotation, "__args__", ())
    kinds += [m for a in args for m in getattr(a, "__metadata__", ()) if isinstance(m, Kind)]
    return Option(name, kinds[0], info.json_schema_extra["style"], info.description, low, high)


OPTIONS: dict[str, Option] = {name: _option(name, info) for name, info in ServeConfig.model_fields.items()}

# Qwen3.5 serving defaults: its reasoning format, its tool-call format, tool calls parsed from
# replies with forced and required calls constrained to each tool's schema, cached prompt tokens
# reported in usage (what replay benchmarks read), the request policy of our middleware, and images:
# at most 16 per prompt, inline only (no fetching), at most 20 MiB and 8192 x 8192 pixels each.
QWEN35_DEFAULTS: dict[str, object] = {
    "reasoning_parser": "qwen3",
    "enable_auto_tool_choice": True,
    "tool_call_parser": "qwen3_coder",
    "tool_strict_level": "parameter",
    "enable_prompt_tokens_details": True,
    "max_n": 8,
    "thinking_off_with_tools": False,
    "max_request_bytes": 32 * 1024 * 1024,
    "max_tool_calls": 8,
    "admin_routes": False,
    "public_metrics": True,
    "fetch_images": False,
    "max_image_bytes": 20 * 1024 * 1024,
    "max_image_pixels": 8192 * 8192,
    "limit_mm_per_prompt": {"image": 16},
}
# What vLLM is told when fetching is off: media URLs may come from this host only, which never resolves (the
# .invalid top-level domain is reserved), so no route makes vLLM fetch anything.
NO_FETCH_DOMAINS = ["fetching-is-off.invalid"]


def _shown(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _message(error: ValidationError, settings: Mapping, where: str) -> str:
    """The first validation error as 'where 'key': expected ..., got value (type)'."""
    first = error.errors()[0]
    name = str(first["loc"][0]) if first["loc"] else ""
    if name in OPTIONS:
        return f"{where} {name!r}: expected {OPTIONS[name].expected}, got {_shown(settings.get(name))}"
    return f"{where}: {first['msg']}"


def unknown_key_message(key: object, where: str) -> str:
    close = difflib.get_close_matches(str(key), OPTIONS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {where} {key!r}{hint}; valid keys: {', '.join(sorted(OPTIONS))}"


def check_value(name: str, value: object, where: str = "config key") -> None:
    """Raise ConfigError unless `value` (non-null) fits option `name`."""
    try:
        ServeConfig.model_validate({name: value})
    except ValidationError as e:
        raise ConfigError(_message(e, {name: value}, where)) from None


def validate(settings: Mapping, source: str = "config") -> dict:
    """The settings as a plain dict, after checking every key and value; `null` values are dropped."""
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{source}: expected a mapping of option names to values, got {type(settings).__name__}")
    for key in settings:
        if key not in OPTIONS:
            raise ConfigError(f"{source}: {unknown_key_message(key, 'key')}")
    try:
        checked = ServeConfig.model_validate(dict(settings))
    except ValidationError as e:
        raise ConfigError(_message(e, settings, f"{source}: key")) from None
    values = checked.model_dump(exclude_none=True)
    return {k: values[k] for k in settings if k in values}


def load_file(path: str | Path) -> dict:
    """Read and validate a YAML config file (an empty file is an empty config); a relative
    `api_key_file` is made absolute against the file's folder."""
    import yaml

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read config {str(path)!r}: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    settings = validate({} if data is None else data, str(path))
    if "api_key_file" in settings:
        settings["api_key_file"] = str(path.parent / Path(settings["api_key_file"]).expanduser())
    return settings


def read_key_file(path: str | Path) -> list[str]:
    """The API keys in `path`: one per line, blank lines and '#' comments skipped. ConfigError
    when the file cannot be read or holds no key."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"api_key_file {str(path)!r}: cannot read it: {e.strerror or e}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ConfigError(f"api_key_file {str(path)!r} holds no key (one per line; '#' starts a comment)")
    return keys


def resolve(*layers: Mapping) -> dict:
    """Later layers win; each layer is validated first."""
    merged: dict = {}
    for layer in layers:
        merged.update(validate(layer, "settings"))
    return merged


def vllm_argv(settings: Mapping) -> list[str]:
    """vLLM's command-line arguments for the resolved settings (our own keys are left out)."""
    argv: list[str] = []
    for name, value in settings.items():
        option = OPTIONS[name]
        if option.style == OURS:
            continue
        if option.style == FLAG:
            argv.append(option.flag if value else "--no-" + option.flag[2:])
        elif option.style == STORE_TRUE:
            argv += [option.flag] if value else []
        elif option.style == JSON:
            argv += [option.flag, json.dumps(value)]
        elif option.style in (NARGS, APPEND):
            values = [value] if isinstance(value, str) else list(value)
            if option.style == NARGS:
                argv += [option.flag, *values] if values else []
            else:
                for v in values:
                    argv += [option.flag, v]
        else:
            argv += [option.flag, str(value)]
    return argv + list(settings.get("vllm_args") or [])
