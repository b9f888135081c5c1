"""Gated DeltaNet kernels: the chunked prefill and the recurrent decode step.

The chunked prefill computes the WY/UT chunk form of :mod:`qwen35.reference.gdn` in two launches, split where its
dependencies split: :mod:`.prepare` does every piece of a chunk that does not need the running state (all chunks in
parallel), :mod:`.scan` walks each sequence's chunks in order with the state in registers and writes the output.
With few (sequence, head) pairs the scan walks the state path alone and a third launch computes every chunk's output
in parallel; one long sequence runs in parts, each part's prepare and output beside the scan of the part before /
after it on other streams (:mod:`.streams`), and a batch of several long sequences in groups of whole sequences the
same way. A batch of at most ``CHUNK`` tokens runs both phases in one launch. :mod:`.plan` chooses among these per
shape, :mod:`.launch` issues the launches, :mod:`.metadata` builds the chunk table once per batch.

Numerics: decays enter only as chunk-local differences ``g_i - g_j`` (i >= j) and ``g_C - g_i``; the state and all
accumulations are fp32. The workspace is bf16 for bf16 inputs and fp32 for fp16/fp32 inputs (fp16 could overflow
there); dots run with bf16 operands for bf16, tf32 for fp16 and fp32-accurate ones (three tf32 passes, or ``ieee``)
for fp32 inputs.

:mod:`.recurrent` is the decode step (1..8 tokens per sequence, state pool updated in place); :mod:`.bench_api` the
entry points for benchmarks and the tuner (forced configs).
"""

from kernels_triton.gdn.launch import gdn_chunk_prefill
from kernels_triton.gdn.metadata import GdnChunkMetadata, chunk_table, prepare_gdn_metadata
from kernels_triton.gdn.recurrent import gdn_recurrent_step

__all__ = ["GdnChunkMetadata", "chunk_table", "gdn_chunk_prefill", "gdn_recurrent_step", "prepare_gdn_metadata"]
