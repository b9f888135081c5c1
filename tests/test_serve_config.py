"""`qwen35-serve`'s config: schema checks, layering, key sources, vLLM argument building (no server is
started)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from serve import launcher
from serve.config import (
    NO_FETCH_DOMAINS,
    OPTIONS,
    OURS,
    QWEN35_DEFAULTS,
    ConfigError,
    ServeConfig,
    load_file,
    read_key_file,
    resolve,
    validate,
    vllm_argv,
)

CONFIGS = Path(__file__).resolve().parents[1] / "serve" / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


# -- schema --------------------------------------------------------------------------------------


def test_unknown_key_names_it_suggests_the_nearest_and_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_file(write(tmp_path, "max_model_length: 2048\n"))
    message = str(info.value)
    assert "unknown key 'max_model_length'" in message
    assert "did you mean 'max_model_len'?" in message
    assert "valid keys: " in message and "tensor_parallel_size" in message and "max_n" in message


@pytest.mark.parametrize(
    "text,expected",
    [
        ("max_model_len: [1, 2]\n", "key 'max_model_len': expected an integer or a size string such as '32k' or '4G', "
                                    "got [1, 2] (list)"),
        ("tensor_parallel_size: '4'\n", "key 'tensor_parallel_size': expected an integer >= 1, got '4' (str)"),
        ("enforce_eager: yes please\n", "key 'enforce_eager': expected true or false, got 'yes please' (str)"),
        ("gpu_memory_utilization: 1.5\n", "key 'gpu_memory_utilization': expected a number in [0.01, 1], got 1.5"),
        ("gpu_memory_utilization: .inf\n", "key 'gpu_memory_utilization': expected a number in [0.01, 1], got inf"),
        ("max_request_bytes: 10\n", "key 'max_request_bytes': expected an integer >= 1024, got 10 (int)"),
        ("fetch_images: 'yes'\n", "key 'fetch_images': expected true or false, got 'yes' (str)"),
        ("max_image_pixels: 0\n", "key 'max_image_pixels': expected an integer >= 1, got 0 (int)"),
        ("allowed_media_domains: a.example\n", "key 'allowed_media_domains': expected a list of strings"),
        ("admin_routes: on please\n", "key 'admin_routes': expected true or false, got 'on please' (str)"),
        ("api_key_file: [a]\n", "key 'api_key_file': expected a string, got ['a'] (list)"),
        ("port: 70000\n", "key 'port': expected an integer in [1, 65535], got 70000 (int)"),
        ("max_n: 0\n", "key 'max_n': expected an integer in [1, 16384], got 0 (int)"),
        ("enable_prefix_caching: 1\n", "key 'enable_prefix_caching': expected true or false, got 1 (int)"),
        ("structured_outputs_config: xgr\n", "key 'structured_outputs_config': expected a mapping, got 'xgr'"),
        ("served_model_name: [a, 3]\n", "key 'served_model_name': expected a string or a list of strings"),
        ("- model\n", "expected a mapping of option names to values, got list"),
        ("model: [unclosed\n", "not valid YAML"),
    ],
)  # fmt: skip
def test_bad_values_name_key_value_and_expected_type(tmp_path, text, expected):
    with pytest.raises(ConfigError) as info:
        load_file(write(tmp_path, text))
    assert expected in str(info.value)


def test_one_pydantic_declaration_gives_types_defaults_and_docs():
    assert set(OPTIONS) == set(ServeConfig.model_fields)
    for name, option in OPTIONS.items():
        info = ServeConfig.model_fields[name]
        assert info.default is None and option.help == info.description and option.help, name
        assert option.style == info.json_schema_extra["style"]
    assert OPTIONS["port"].expected == "an integer in [1, 65535]" and OPTIONS["max_n"].low == 1
    assert validate({"port": 9000, "gpu_memory_utilization": 1}) == {"port": 9000, "gpu_memory_utilization": 1.0}
    with pytest.raises(ConfigError, match="unknown key 'ports'"):
        validate({"ports": 1})


def test_null_means_unset_and_an_empty_file_is_an_empty_config(tmp_path):
    assert load_file(write(tmp_path, "")) == {}
    assert load_file(write(tmp_path, "model: null\nport: 9000\n")) == {"port": 9000}
    with pytest.raises(ConfigError, match="cannot read config"):
        load_file(tmp_path / "missing.yaml")


def test_later_layers_win():
    assert resolve({"port": 1, "max_n": 2}, {"port": 3}) == {"port": 3, "max_n": 2}
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        resolve({"bogus": 1})


def test_vllm_argv_spells_each_style():
    argv = vllm_argv({
        "model": "/m", "max_model_len": "32k", "enforce_eager": True, "enable_prefix_caching": False,
        "disable_log_stats": False, "api_key": "k", "served_model_name": ["a", "b"], "middleware": ["x.Y", "z.W"],
        "structured_outputs_config": {"backend": "xgrammar"}, "allowed_origins": ["*"], "max_n": 4,
        "vllm_args": ["--seed", "7"],
    })  # fmt: skip
    assert argv == [
        "--model", "/m", "--max-model-len", "32k", "--enforce-eager", "--no-enable-prefix-caching",
        "--api-key", "k", "--served-model-name", "a", "b", "--middleware", "x.Y", "--middleware", "z.W",
        "--structured-outputs-config", '{"backend": "xgrammar"}', "--allowed-origins", '["*"]', "--seed", "7",
    ]  # fmt: skip
    assert vllm_argv({"disable_log_stats": True}) == ["--disable-log-stats"]


# -- layering ------------------------------------------------------------------------------------


def test_plan_without_a_model_serves_the_embedded_qwen35_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("QWEN35_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    settings, env = launcher.plan({"port": 9000}, {"max_model_len": 2048}, cpu=True)
    model = Path(settings["model"])
    assert model.parent == tmp_path / "embedded" and model.name.startswith("Qwen3_5ForConditionalGeneration-")
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"] and "vision_config" in config
    assert (model / "preprocessor_config.json").is_file(), "the embedded model takes images"
    assert settings["fetch_images"] is False and settings["allowed_media_domains"] == NO_FETCH_DOMAINS
    assert settings["limit_mm_per_prompt"] == {"image": 16}
    for key, value in QWEN35_DEFAULTS.items():
        assert settings[key] == launcher.EMBEDDED_DEFAULTS.get(key, value)
    assert settings["default_chat_template_kwargs"] == {"enable_thinking": False}, "the embedded model: thinking off"
    assert settings["max_num_batched_tokens"] == launcher.CPU_SCHEDULING["max_num_batched_tokens"]
    assert settings["served_model_name"] == "qwen35-tiny" and settings["dtype"] == "float32"
    assert settings["max_model_len"] == 2048 and settings["port"] == 9000, "file and overrides win over defaults"
    assert settings["enforce_eager"] is True and settings["kv_cache_memory_bytes"] == "1G"
    assert settings["middleware"] == [launcher.MIDDLEWARE] and env == {}


def test_plan_with_a_model_keeps_the_user_settings_and_adds_cpu_ones(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    user = {"model": "/m", "enforce_eager": False, "reasoning_parser": "deepseek_r1", "middleware": "a.B"}
    settings, env = launcher.plan(user, {}, cpu=True)
    assert settings["model"] == "/m" and "served_model_name" not in settings and "dtype" not in settings
    assert settings["enforce_eager"] is False and settings["reasoning_parser"] == "deepseek_r1"
    assert settings["kv_cache_memory_bytes"] == launcher.CPU_KV_CACHE
    assert settings["middleware"] == ["a.B", launcher.MIDDLEWARE]
    gpu, _ = launcher.plan(user, {}, cpu=False)
    assert "kv_cache_memory_bytes" not in gpu and "enforce_eager" in gpu
    fetching, _ = launcher.plan({**user, "fetch_images": True, "allowed_media_domains": ["img.example"]}, {},
                                cpu=False)  # fmt: skip
    assert fetching["allowed_media_domains"] == ["img.example"], "fetching on: the user's hosts reach vLLM"
    assert (
        launcher.plan({**user, "allowed_media_domains": ["img.example"]}, {}, cpu=False)[0]["allowed_media_domains"]
        == NO_FETCH_DOMAINS
    ), "fetching off: vLLM may fetch from no host"
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        _, env = launcher.plan({"model": "/m", "tensor_parallel_size": 2}, {}, cpu=True)
        half = len(cores) // 2
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == f"{cores[0]}-{cores[half - 1]}|{cores[half]}-{cores[2 * half - 1]}"
    with pytest.raises(ConfigError, match="needs at least 4096 CPU cores"):
        launcher.plan({"model": "/m", "tensor_parallel_size": 4096}, {}, cpu=True)


def test_command_line_overrides_are_typed_by_the_schema():
    parser = launcher.build_parser()
    ns = parser.parse_args(["cfg.yaml", "--port", "9001", "--no-enforce-eager", "--max-model-len", "32k",
                            "--served-model-name", "a", "b", "--structured-outputs-config", '{"backend": "xgrammar"}',
                            "--model", "123"])  # fmt: skip
    values = {n: launcher.parse_override(n, getattr(ns, n)) for n in OPTIONS if getattr(ns, n) is not None}
    assert ns.config == "cfg.yaml"
    assert values == {"port": 9001, "enforce_eager": False, "max_model_len": "32k", "served_model_name": ["a", "b"],
                      "structured_outputs_config": {"backend": "xgrammar"}, "model": "123"}  # fmt: skip
    with pytest.raises(ConfigError, match=r"option 'port': expected an integer in \[1, 65535\], got 'eighty'"):
        launcher.parse_override("port", "eighty")
    with pytest.raises(ConfigError, match="expected a mapping"):
        launcher.parse_override("compilation_config", "{not yaml")
    assert launcher.split_argv(["c.yaml", "--port", "1", "--", "--seed", "3"]) == (["c.yaml", "--port", "1"],
                                                                                   ["--seed", "3"])  # fmt: skip


# -- API keys ------------------------------------------------------------------------------------


def test_api_key_file_is_read_relative_to_the_config_and_never_shown(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    (tmp_path / "keys").write_text("# serving keys\n\nkey-one\n  key-two  \n")
    settings = load_file(write(tmp_path, "api_key_file: keys\nmodel: /m\n"))
    assert settings["api_key_file"] == str(tmp_path / "keys")
    planned, _ = launcher.plan(settings, {}, cpu=False)
    assert planned["api_key"] == ["key-one", "key-two"]
    assert "key-one" not in json.dumps(launcher.shown(planned))
    with_key, _ = launcher.plan(settings, {"api_key": "cli-key"}, cpu=False)
    assert with_key["api_key"] == "cli-key", "api_key (config or command line) wins over api_key_file"


def test_key_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match=r"api_key_file '.*missing': cannot read it"):
        read_key_file(tmp_path / "missing")
    (tmp_path / "empty").write_text("# nothing here\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        read_key_file(tmp_path / "empty")


def test_admin_routes_need_a_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="admin_routes: true needs an API key"):
        launcher.plan({"model": "/m", "admin_routes": True}, {}, cpu=False)
    settings, _ = launcher.plan({"model": "/m", "admin_routes": True}, {"api_key": "k"}, cpu=False)
    assert settings["admin_routes"] is True
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    launcher.plan({"model": "/m", "admin_routes": True}, {}, cpu=False)


def test_a_key_on_the_command_line_warns_why_and_is_not_printed(tmp_path):
    script = Path(sys.executable).with_name("qwen35-serve")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "serve.launcher"]
    proc = subprocess.run([*command, str(write(tmp_path, "model: /m\n")), "--api-key", "s3cret-key", "--dry-run"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "WARNING: the API key given with --api-key is visible to every user of this host" in proc.stderr
    assert "api_key_file" in proc.stderr and "VLLM_API_KEY" in proc.stderr
    assert "s3cret-key" not in proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["settings"]["api_key"] == "***"


# -- the CLI exits non-zero with a message ------------------------------------------------------


@pytest.mark.parametrize(
    "text,args,message",
    [
        ("max_seqs: 4\n", [], "unknown key 'max_seqs' (did you mean 'max_num_seqs'?); valid keys: "),
        ("max_num_seqs: four\n", [], "key 'max_num_seqs': expected an integer >= 1, got 'four' (str)"),
        ("", ["--port", "http"], "option 'port': expected an integer in [1, 65535], got 'http' (str)"),
    ],
)
def test_cli_config_errors_exit_2_with_a_message(tmp_path, text, args, message):
    script = Path(sys.executable).with_name("qwen35-serve")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "serve.launcher"]
    proc = subprocess.run([*command, str(write(tmp_path, text)), *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stderr.startswith("qwen35-serve: ")


def test_config_errors_are_found_without_importing_vllm_or_torch(tmp_path):
    script = ("import sys; from serve.launcher import main; "
              f"rc = main([{str(write(tmp_path, 'max_seqs: 4'))!r}]); "
              "print(rc, sorted(m for m in ('vllm', 'torch') if m in sys.modules))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split("\n")[0] == "2 []", proc.stdout + proc.stderr


def test_example_configs_are_valid(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    tp4 = load_file(CONFIGS / "qwen35-27b-tp4.yaml")
    assert tp4["tensor_parallel_size"] == 4 and tp4["model"].endswith("Qwen3.5-27B")
    settings, _ = launcher.plan(tp4, {}, cpu=False)
    assert settings["tool_call_parser"] == "qwen3_coder" and settings["reasoning_parser"] == "qwen3"
    embedded = load_file(CONFIGS / "embedded-cpu.yaml")
    assert "model" not in embedded
    planned, _ = launcher.plan(embedded, {}, cpu=True)
    default, _ = launcher.plan({}, {}, cpu=True)
    assert {k: v for k, v in planned.items() if k not in ("host", "port")} == default, "the file spells the defaults"


# -- against vLLM's own parser -------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_parser():
    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def test_every_vllm_key_is_a_vllm_option_with_a_matching_action(vllm_parser):
    import argparse

    actions = {a.dest: a for a in vllm_parser._actions}
    for option in OPTIONS.values():
        if option.style == OURS:
            assert option.name not in actions, f"{option.name} shadows a vLLM option"
            continue
        assert option.name in actions, f"{option.name} is not a vLLM {sys.modules['vllm'].__version__} option"
        action = actions[option.name]
        assert option.flag in action.option_strings
        if option.style == "flag":
            assert isinstance(action, argparse.BooleanOptionalAction), option.name
        if option.style == "store_true":
            assert action.nargs == 0 and action.const is True, option.name
        if option.style == "nargs":
            assert action.nargs == "+", option.name
        if option.style == "append":
            assert isinstance(action, argparse._AppendAction), option.name


def test_vllm_parses_what_the_example_configs_become(vllm_parser, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    settings, _ = launcher.plan(load_file(CONFIGS / "qwen35-27b-tp4.yaml"), {"api_key": "k"}, cpu=False)
    args = vllm_parser.parse_args(vllm_argv(settings))
    assert args.model == "/models/Qwen3.5-27B" and args.tensor_parallel_size == 4 and args.max_model_len == 32768
    assert args.enable_prefix_caching is True and args.enforce_eager is False and args.api_key == ["k"]
    assert args.enable_auto_tool_choice and args.tool_call_parser == "qwen3_coder" and args.reasoning_parser == "qwen3"
    assert args.middleware == [launcher.MIDDLEWARE] and args.served_model_name == ["qwen3.5-27b"]
    embedded, _ = launcher.plan({}, {}, cpu=True)
    args = vllm_parser.parse_args(vllm_argv(embedded))
    assert args.dtype == "float32" and args.structured_outputs_config.disable_any_whitespace is True
    assert args.kv_cache_memory_bytes == 1 << 30


def test_validate_rejects_non_mappings():
    with pytest.raises(ConfigError, match="expected a mapping"):
        validate(["port"])
