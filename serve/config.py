"""`qwen35-serve`'s configuration: a YAML mapping whose keys mirror vLLM's server options.

A config file sets any of the keys in `OPTIONS` (vLLM's own option names with underscores, plus a
few of ours); `null` means "vLLM's default". Unknown keys and values of the wrong type are errors
that name the key, the value and what was expected, so a typo never silently becomes a default:

    model: /models/Qwen3.5-27B          # omitted or null: the embedded tiny checkpoint
    tensor_parallel_size: 4
    max_model_len: 32768
    max_n: 8                            # one of ours: larger n is answered 400

(The API key is better left out of files: vLLM reads `VLLM_API_KEY` from the environment.)

Settings are resolved in layers, each only filling keys that a later one leaves unset:
vLLM's defaults < `QWEN35_DEFAULTS` < host defaults (`qwen35-serve` adds the embedded model's and a
CPU host's) < the config file < command-line overrides. `vllm_argv()` turns the result into the
argument list vLLM's own parser reads, so vLLM still does the value conversion it always does.

This module imports neither vLLM nor torch: a config is checked in milliseconds.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

# How a value reaches vLLM's argument parser.
PLAIN = "plain"  # --name VALUE
FLAG = "flag"  # --name / --no-name
STORE_TRUE = "store_true"  # --name when true, nothing when false
NARGS = "nargs"  # --name V1 V2 ...
APPEND = "append"  # --name V1 --name V2 ...
JSON = "json"  # --name '<json>'
OURS = "ours"  # read by qwen35-serve itself, never passed to vLLM


class ConfigError(ValueError):
    """A configuration that cannot be served: the message names the key and what was expected."""


@dataclass(frozen=True)
class Kind:
    """A value type: `check(value)` says whether a (non-null) value has it; `name` is for messages."""

    name: str
    check: Callable[[object], bool]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


INT = Kind("an integer", _is_int)
NUMBER = Kind("a number", _is_number)
BOOL = Kind("true or false", lambda v: isinstance(v, bool))
STR = Kind("a string", lambda v: isinstance(v, str))
SIZE = Kind("an integer or a size string such as '32k' or '4G'", lambda v: _is_int(v) or isinstance(v, str))
STRS = Kind("a string or a list of strings", lambda v: isinstance(v, str) or (
    isinstance(v, list) and all(isinstance(x, str) for x in v)))
MAPPING = Kind("a mapping", lambda v: isinstance(v, dict))
STR_LIST = Kind("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v))


@dataclass(frozen=True)
class Option:
    name: str
    kind: Kind
    style: str
    help: str
    low: float | None = None  # inclusive bounds for numbers
    high: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _opts(style: str, kind: Kind, names: str, help: str, low: float | None = None, high: float | None = None):
    return [Option(n, kind, style, help, low, high) for n in names.split()]


OPTIONS: dict[str, Option] = {o.name: o for o in [
    # -- ours ------------------------------------------------------------------------------------
    Option("max_n", INT, OURS, "largest `n` a request may ask for (more is answered 400)", 1, 16384),
    Option("thinking_off_with_tools", BOOL, OURS,
           "turn thinking off for requests that offer tools with tool_choice auto, unless they ask for it"),
    Option("text_only", BOOL, OURS,
           "refuse image/audio/video parts with a clear 400 (null: when the served model takes no media)"),
    Option("max_request_bytes", INT, OURS, "largest request body accepted (more is answered 413)", 1024),
    Option("vllm_args", STR_LIST, OURS, "extra vLLM command-line arguments, appended verbatim"),
    # -- model -----------------------------------------------------------------------------------
    Option("model", STR, PLAIN, "checkpoint directory or hub id (null: the embedded tiny Qwen3.5 checkpoint)"),
    *_opts(PLAIN, STR, "tokenizer revision dtype kv_cache_dtype quantization chat_template generation_config "
           "load_format download_dir chat_template_content_format mamba_cache_mode mamba_ssm_cache_dtype "
           "reasoning_parser tool_call_parser distributed_executor_backend", "vLLM option"),
    Option("seed", INT, PLAIN, "vLLM option"),
    Option("max_model_len", SIZE, PLAIN, "vLLM option: context length (tokens; '32k' and 'auto' work too)"),
    *_opts(FLAG, BOOL, "trust_remote_code language_model_only", "vLLM option"),
    *_opts(JSON, MAPPING, "hf_overrides override_generation_config limit_mm_per_prompt", "vLLM option"),
    # -- server ----------------------------------------------------------------------------------
    Option("host", STR, PLAIN, "vLLM option: address to bind"),
    Option("port", INT, PLAIN, "vLLM option: port to bind", 1, 65535),
    Option("api_key", STRS, NARGS, "vLLM option: accepted bearer key(s) (or set VLLM_API_KEY)"),
    Option("served_model_name", STRS, NARGS, "vLLM option: model name(s) the API answers to"),
    Option("middleware", STRS, APPEND, "vLLM option: extra ASGI middleware import paths (ours is always added)"),
    Option("allowed_origins", STR_LIST, JSON, "vLLM option: CORS origins"),
    *_opts(PLAIN, STR, "uvicorn_log_level root_path ssl_keyfile ssl_certfile", "vLLM option"),
    Option("api_server_count", INT, PLAIN, "vLLM option", 1),
    *_opts(FLAG, BOOL, "disable_uvicorn_access_log enable_log_requests disable_fastapi_docs "
           "enable_prompt_tokens_details enable_force_include_usage enable_auto_tool_choice "
           "return_tokens_as_token_ids", "vLLM option"),
    Option("disable_log_stats", BOOL, STORE_TRUE, "vLLM option"),
    Option("max_logprobs", INT, PLAIN, "vLLM option", 0),
    *_opts(JSON, MAPPING, "structured_outputs_config default_chat_template_kwargs", "vLLM option"),
    # -- engine ----------------------------------------------------------------------------------
    Option("gpu_memory_utilization", NUMBER, PLAIN, "vLLM option: share of accelerator memory to use", 0.01, 1.0),
    Option("kv_cache_memory_bytes", SIZE, PLAIN, "vLLM option: KV cache size instead of a memory share ('4G')"),
    *_opts(PLAIN, INT, "max_num_seqs tensor_parallel_size pipeline_parallel_size data_parallel_size block_size "
           "max_cudagraph_capture_size", "vLLM option", 1),
    Option("max_num_batched_tokens", SIZE, PLAIN, "vLLM option"),
    Option("cpu_offload_gb", NUMBER, PLAIN, "vLLM option", 0),
    *_opts(FLAG, BOOL, "enforce_eager enable_prefix_caching enable_chunked_prefill enable_expert_parallel "
           "async_scheduling", "vLLM option"),
    *_opts(JSON, MAPPING, "compilation_config speculative_config", "vLLM option"),
]}  # fmt: skip

# Qwen3.5 serving defaults: its reasoning format, its tool-call format, tool calls parsed from
# replies, and cached prompt tokens reported in usage (what replay benchmarks read).
QWEN35_DEFAULTS: dict[str, object] = {
    "reasoning_parser": "qwen3",
    "enable_auto_tool_choice": True,
    "tool_call_parser": "qwen3_coder",
    "enable_prompt_tokens_details": True,
    "max_n": 8,
    "thinking_off_with_tools": False,
    "max_request_bytes": 32 * 1024 * 1024,
}


def check_value(name: str, value: object, where: str = "config key") -> None:
    """Raise ConfigError unless `value` (non-null) fits option `name`."""
    option = OPTIONS[name]
    shown = f"{value!r} ({type(value).__name__})"
    if not option.kind.check(value):
        raise ConfigError(f"{where} {name!r}: expected {option.kind.name}, got {shown}")
    if option.kind in (INT, NUMBER):
        if option.low is not None and value < option.low or option.high is not None and value > option.high:
            bounds = f"[{option.low:g}, {option.high:g}]" if option.high is not None else f">= {option.low:g}"
            raise ConfigError(f"{where} {name!r}: expected {option.kind.name} in {bounds}, got {shown}")


def unknown_key_message(key: object, where: str) -> str:
    close = difflib.get_close_matches(str(key), OPTIONS, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {where} {key!r}{hint}; valid keys: {', '.join(sorted(OPTIONS))}"


def validate(settings: Mapping, source: str = "config") -> dict:
    """The settings as a plain dict, after checking every key and value; `null` values are dropped."""
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{source}: expected a mapping of option names to values, got {type(settings).__name__}")
    checked = {}
    for key, value in settings.items():
        if key not in OPTIONS:
            raise ConfigError(f"{source}: {unknown_key_message(key, 'key')}")
        if value is None:
            continue
        check_value(key, value, f"{source}: key")
        checked[key] = value
    return checked


def load_file(path: str | Path) -> dict:
    """Read and validate a YAML config file (an empty file is an empty config)."""
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
    return validate({} if data is None else data, str(path))


def resolve(*layers: Mapping) -> dict:
    """Later layers win; each layer is validated first."""
    merged: dict = {}
    for layer in layers:
        merged.update(validate(layer, "settings"))
    return merged


def vllm_argv(settings: Mapping) -> list[str]:
    """vLLM's command-line arguments for the resolved settings (our own keys are left out)."""
    import json

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
