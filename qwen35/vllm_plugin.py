"""vLLM plugin (entry point ``vllm.general_plugins: qwen35``): registers our model classes.

vLLM runs :func:`register` in every process it starts, so ``vllm serve <checkpoint>`` picks the
Qwen3.5 architectures up with no extra flag. Registration is lazy (a ``module:Class`` string):
nothing heavy is imported until vLLM builds the model. The ``*ForCausalLM`` architectures get the
text class (:mod:`qwen35.vllm_host`), the ``*ForConditionalGeneration`` ones the class that also takes
images (:mod:`qwen35.vllm_multimodal`). It also applies the fixes of :mod:`qwen35.vllm_adapter` that
the installed vLLM needs.
"""

from __future__ import annotations

from qwen35.config import ARCHITECTURES

MODEL_CLASS = "qwen35.vllm_host:Qwen35ForVllm"
VISION_MODEL_CLASS = "qwen35.vllm_multimodal:Qwen35VisionForVllm"


def model_class(architecture: str) -> str:
    """The ``module:Class`` registered for an architecture of :data:`qwen35.config.ARCHITECTURES`."""
    _, nested = ARCHITECTURES[architecture]  # ConditionalGeneration checkpoints carry the vision tower
    return VISION_MODEL_CLASS if nested else MODEL_CLASS


def register() -> None:
    from vllm import ModelRegistry

    from qwen35 import vllm_adapter

    vllm_adapter.install()
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, model_class(arch))
