"""qwen35: kernels, model hosts and serving for Qwen3.5 hybrid models.

``qwen35.ops`` is the op façade (validated ops, backend chosen per op by ``qwen35.probe``);
``qwen35.reference`` the plain-PyTorch ground truth. Importing this package imports torch only.
"""

__version__ = "0.1.0"
