"""`qwen35-serve`: vLLM's OpenAI-compatible server, in this process, with qwen35's model and fixes.

    qwen35-serve [CONFIG.yaml] [--model PATH] [--port N] [--KEY VALUE ...] [-- EXTRA VLLM ARGS]

Every key of `serve.config.OPTIONS` is also a command-line override (`--max-model-len 8192`,
`--enforce-eager` / `--no-enforce-eager`); overrides win over the file. What it does:

1. checks the config (unknown keys, wrong types: exit 2 with a message, before anything heavy);
2. with no model, builds once (cached on disk) the embedded tiny Qwen3.5 checkpoint and serves it,
   with thinking off unless a request asks for it (a random-weight model never ends its thinking);
3. fills unset keys with Qwen3.5's serving defaults and, on a CPU host, the CPU engine's settings
   (eager mode, a KV cache size, scheduling that keeps token gaps short, thread binding for
   tensor parallelism); with `fetch_images` off (the default) vLLM is also told that media URLs may
   come from no reachable host, so no route fetches one;
4. reads the API key(s): `api_key` (config or `--api-key`, which prints a WARNING: a command line
   is visible to every user of the host), else the file named by `api_key_file`, else vLLM's
   `VLLM_API_KEY` environment variable; keys are never logged or printed;
5. hands the result to vLLM's own argument parser and `vllm serve` code path, with
   `serve.middleware.RequestCompatMiddleware` added to the app. The model class comes from our
   vLLM plugin (entry point `vllm.general_plugins: qwen35`), which logs the kernel probe once.

Exit status: 0 after an ordinary stop (SIGTERM, SIGINT), 2 for a config error, and
`serve.lifecycle.ENGINE_DEAD_STATUS` (3) when the engine died while serving, so that a restart
policy (Docker's `--restart on-failure`, systemd's `Restart=on-failure`) brings the server back.

`--dry-run` prints the resolved settings and vLLM's arguments as JSON and exits.

This module is a vLLM host: it imports vLLM, but only after the config has been checked.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from serve.config import (
    BOOL,
    MAPPING,
    NO_FETCH_DOMAINS,
    OPTIONS,
    QWEN35_DEFAULTS,
    STR,
    STR_LIST,
    STRS,
    ConfigError,
    check_value,
    load_file,
    read_key_file,
    resolve,
    vllm_argv,
)

MIDDLEWARE = "serve.middleware.RequestCompatMiddleware"
COMPAT_KEYS = (
    "max_n",
    "thinking_off_with_tools",
    "text_only",
    "max_request_bytes",
    "admin_routes",
    "public_metrics",
    "tool_string_max_chars",
    "max_tool_calls",
    "fetch_images",
    "max_image_bytes",
    "max_image_pixels",
)
CPU_KV_CACHE = "4G"
COMMAND_LINE_KEY_WARNING = (
    "qwen35-serve: WARNING: the API key given with --api-key is visible to every user of this host (ps, "
    "/proc/<pid>/cmdline) and stays in shell history; name a file holding it with api_key_file in the config, "
    "or set the VLLM_API_KEY environment variable"
)

# The embedded model is a random toy: compact JSON under grammars (it would pad with whitespace
# forever), float32 (bf16 logits tie at the top, which makes greedy and top_k=1 disagree), a
# small KV cache on any host, thinking off unless asked for (it would never close its thinking,
# so a plain chat would return no content), and short strings and few calls in constrained tool
# calls (it would never close a string, and would chain calls until max_tokens).
EMBEDDED_DEFAULTS: dict[str, object] = {
    "served_model_name": "qwen35-tiny",
    "dtype": "float32",
    "max_model_len": 4096,
    "kv_cache_memory_bytes": "1G",
    "enable_prefix_caching": True,
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
    "default_chat_template_kwargs": {"enable_thinking": False},
    "tool_string_max_chars": 16,
    "max_tool_calls": 4,
}

# Scheduling on a CPU host: an engine step computes at most 512 tokens (vLLM's CPU default is
# 2048), and one request's prefill at most 256 of them while others run, so long prompts are
# prefilled in short steps beside the decoding streams and the longest step is bounded. Embedded
# model, concurrency 16, 2 shared cores: token gap p99 107-139 ms against 197-213 ms with vLLM's
# defaults at moderate load, no difference at load 8-10 (tuning/notes_serve.md).
CPU_SCHEDULING: dict[str, object] = {
    "max_num_batched_tokens": 512,
    "long_prefill_token_threshold": 256,
}

log = logging.getLogger("vllm.qwen35.serve")


# -- command line --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen35-serve",
        description="Serve a Qwen3.5 model (default: the embedded tiny one) with vLLM's OpenAI-compatible server.",
        epilog="Config keys (also overrides, as --key-name): " + ", ".join(sorted(OPTIONS)),
    )
    parser.add_argument("config", nargs="?", help="YAML config file (keys mirror vLLM's options)")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved settings and vLLM's arguments")
    group = parser.add_argument_group("overrides (win over the config file)")
    for option in OPTIONS.values():
        if option.kind is BOOL:
            group.add_argument(option.flag, dest=option.name, action=argparse.BooleanOptionalAction, default=None,
                               help=option.help)  # fmt: skip
        elif option.kind in (STRS, STR_LIST):
            group.add_argument(option.flag, dest=option.name, nargs="+", default=None, help=option.help)
        else:
            group.add_argument(option.flag, dest=option.name, default=None, metavar="VALUE", help=option.help)
    return parser


def parse_override(name: str, text: object) -> object:
    """A command-line value for option `name`: strings stay strings, the rest is read as YAML."""
    import yaml

    option = OPTIONS[name]
    if option.kind in (STR, BOOL, STRS, STR_LIST) or not isinstance(text, str):
        value = text
    else:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        if option.kind is MAPPING and isinstance(value, str):
            raise ConfigError(f"option {option.flag}: expected a mapping (JSON or YAML), got {text!r}")
    check_value(name, value, "option")
    return value


def split_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """Our arguments, and what follows a bare `--` (passed to vLLM verbatim)."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


# -- settings ------------------------------------------------------------------------------------


def embedded_checkpoint() -> str:
    from serve.embedded.checkpoint import DEFAULT_ARCHITECTURE, ensure_checkpoint

    return str(ensure_checkpoint(DEFAULT_ARCHITECTURE))


def cpu_defaults(settings: dict) -> tuple[dict, dict[str, str]]:
    """Settings and environment the CPU engine needs, for keys the user left unset.

    Eager mode (torch.compile costs most of a CPU start-up), a fixed KV cache size (the CPU engine
    otherwise takes a share of the machine's memory), `CPU_SCHEDULING`, and, for tensor
    parallelism, the cores each rank binds its OpenMP threads to (vLLM's 'auto' needs one NUMA node
    per rank).
    """
    layer: dict = {"enforce_eager": True, **CPU_SCHEDULING}
    env: dict[str, str] = {}
    if "kv_cache_memory_bytes" not in settings and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        layer["kv_cache_memory_bytes"] = CPU_KV_CACHE
    tp = int(settings.get("tensor_parallel_size", 1))
    if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        per_rank = len(cores) // tp
        if per_rank < 1:
            raise ConfigError(f"tensor_parallel_size={tp} needs at least {tp} CPU cores, this host has {len(cores)}")
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{cores[r * per_rank]}-{cores[(r + 1) * per_rank - 1]}" for r in range(tp)
        )
    return layer, env


def on_cpu_host() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def plan(file_settings: dict, overrides: dict, cpu: bool | None = None) -> tuple[dict, dict[str, str]]:
    """The resolved settings (defaults < host defaults < file < overrides) and environment to set."""
    user = resolve(file_settings, overrides)
    layers: list[dict] = [QWEN35_DEFAULTS]
    embedded = "model" not in user
    if embedded:
        layers.append({**EMBEDDED_DEFAULTS, "model": embedded_checkpoint()})
    env: dict[str, str] = {}
    if cpu if cpu is not None else on_cpu_host():
        host, env = cpu_defaults(resolve(*layers, user))
        layers.append(host)
    settings = resolve(*layers, user)
    if not settings.get("fetch_images"):
        settings["allowed_media_domains"] = list(NO_FETCH_DOMAINS)  # no route makes vLLM fetch a URL
    settings["middleware"] = [m for m in _as_list(settings.get("middleware")) if m != MIDDLEWARE] + [MIDDLEWARE]
    if "api_key" not in settings and "api_key_file" in settings:
        settings["api_key"] = read_key_file(settings["api_key_file"])
    if settings.get("admin_routes") and "api_key" not in settings and not os.environ.get("VLLM_API_KEY"):
        raise ConfigError("admin_routes: true needs an API key (api_key_file, the VLLM_API_KEY environment variable, "
                          "or api_key): the admin routes change the server's state")  # fmt: skip
    return settings, env


def _as_list(value: object) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def shown(settings: dict) -> dict:
    """Settings safe to print (keys masked)."""
    return {k: ("***" if k == "api_key" else v) for k, v in settings.items()}


# -- serving -------------------------------------------------------------------------------------


def serve(settings: dict, extra_vllm_args: list[str], env: dict[str, str]) -> None:
    """Run vLLM's OpenAI server in this process until it is stopped."""
    os.environ.update(env)
    from qwen35.vllm_adapter import serve_api
    from serve.middleware import SETTINGS_ATTR

    api = serve_api()  # vLLM's serve entry points for the installed version (a clear error outside the range)
    api.cli_env_setup()
    parser = api.make_arg_parser(api.FlexibleArgumentParser(prog="qwen35-serve (vLLM arguments)"))
    args = parser.parse_args(vllm_argv(settings) + extra_vllm_args)
    setattr(args, SETTINGS_ATTR, {k: settings[k] for k in COMPAT_KEYS if k in settings})
    api.configure_logging(args)
    api.validate_parsed_serve_args(args)
    log.info("qwen35-serve: %s", json.dumps(shown(settings), default=str))
    api.ServeSubcommand.cmd(args)


def main(argv: Sequence[str] | None = None) -> int:
    from serve import lifecycle

    ours, extra = split_argv(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(ours)
    if ns.api_key is not None:
        print(COMMAND_LINE_KEY_WARNING, file=sys.stderr)
    try:
        file_settings = load_file(ns.config) if ns.config else {}
        overrides = {name: parse_override(name, getattr(ns, name)) for name in OPTIONS
                     if getattr(ns, name) is not None}  # fmt: skip
        settings, env = plan(file_settings, overrides)
    except ConfigError as e:
        print(f"qwen35-serve: {e}", file=sys.stderr)
        return 2
    if ns.dry_run:
        print(json.dumps({"settings": shown(settings), "env": env,
                          "vllm_args": vllm_argv(shown(settings)) + extra}, indent=2))  # fmt: skip
        return 0
    serve(settings, extra, env)
    return lifecycle.ENGINE_DEAD_STATUS if lifecycle.engine_died() else 0


if __name__ == "__main__":
    sys.exit(main())
