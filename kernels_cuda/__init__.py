"""CUDA backends: ``cuda_sm70`` (CUDA C++ restricted to SM70 features, JIT-built), ``ixformer`` and ``flashqla``.

- :mod:`kernels_cuda.sm70`: the backend module (ops with the façade's signatures, ``availability``).
- :mod:`kernels_cuda.build`: the JIT build (compiler, target arch, flags, cache) of ``csrc/``.
- :mod:`kernels_cuda.ixformer`: the Iluvatar ixformer adapter (the ops its known calls cover).
- :mod:`kernels_cuda.flashqla`: the FlashQLA adapter (GDN prefill; optional extra ``[flashqla]``; it hands the
  batches FlashQLA does not take to ``kernels_triton``, which it imports).

Imports only torch at import time; the CUDA sources are compiled on first use.
"""
