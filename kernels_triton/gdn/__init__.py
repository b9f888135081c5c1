"""Gated DeltaNet kernels: chunked prefill (:mod:`.chunk`) and the recurrent decode step (:mod:`.recurrent`)."""

from kernels_triton.gdn.chunk import GdnChunkMetadata, chunk_table, gdn_chunk_prefill, prepare_gdn_metadata
from kernels_triton.gdn.recurrent import gdn_recurrent_step

__all__ = ["GdnChunkMetadata", "chunk_table", "gdn_chunk_prefill", "gdn_recurrent_step", "prepare_gdn_metadata"]
