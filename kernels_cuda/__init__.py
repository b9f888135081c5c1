"""CUDA backends: ``cuda_sm70`` (CUDA C++ restricted to SM70 features, JIT-built) and ``ixformer``.

Imports only torch at import time; sources are compiled on first use.
"""
