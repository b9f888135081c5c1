"""vLLM adapter: the places where qwen35 reaches into vLLM internals that differ between versions.

:func:`install` runs from the plugin's ``register()`` in every vLLM process, before any engine is
built. It applies the fixes qwen35 needs on top of the installed vLLM:

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
import logging

import numpy as np

log = logging.getLogger("vllm.qwen35")

_PATCHED = "_qwen35_seeded_rewind"


def install() -> None:
    """Apply the fixes that the installed vLLM needs (idempotent)."""
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
