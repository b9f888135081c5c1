"""Arrows point down: the façade and the kernel packages import nothing beyond torch, triton and numpy."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("vllm", "fastapi", "starlette", "uvicorn", "pydantic", "transformers", "openai", "httpx", "yaml",
             "safetensors", "fla", "serve", "tuning")


def test_facade_and_kernels_import_only_torch_triton_numpy():
    code = (
        "import sys, json\n"
        "import qwen35, qwen35.ops, qwen35.probe, qwen35.reference, qwen35.selftest, qwen35.optable\n"
        "import qwen35.validate, qwen35.cases, qwen35.knobs, qwen35.backends\n"
        "import kernels_triton, kernels_cuda, kernels_cuda.sm70, kernels_cuda.ixformer\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout))
    bad = sorted(loaded & set(FORBIDDEN))
    assert not bad, f"importing the façade/kernels pulled in {bad}"
