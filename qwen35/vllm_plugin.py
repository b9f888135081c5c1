"""vLLM plugin (entry point ``vllm.general_plugins: qwen35``): registers our model class.

vLLM runs :func:`register` in every process it starts, so ``vllm serve <checkpoint>`` picks the
Qwen3.5 architectures up with no extra flag. Registration is lazy (a ``module:Class`` string):
nothing heavy is imported until vLLM builds the model. It also applies the fixes of
:mod:`qwen35.vllm_adapter` that the installed vLLM needs.
"""

from __future__ import annotations

from qwen35.config import ARCHITECTURES

MODEL_CLASS = "qwen35.vllm_host:Qwen35ForVllm"


def register() -> None:
    from vllm import ModelRegistry

    from qwen35 import vllm_adapter

    vllm_adapter.install()
    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, MODEL_CLASS)
