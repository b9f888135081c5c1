"""The chunked GDN prefill's entry point: inputs checked, the chunk table and the plan looked up, launches issued.

Host cost matters here (short prompts at TP4/TP8 are host-bound): one workspace allocation (kept per thread and
stream for batches of at most ``CHUNK`` tokens), plans cached (:mod:`.plan`), kernels launched through
:class:`~kernels_triton._launch.DirectLauncher` with their arguments as named tuples (:mod:`.prepare`, :mod:`.scan`):
the call's values in the kernel's parameter order, then the plan's tail (built by name once per plan); a part's
arguments are the call's with fields replaced by name. Building a launch's arguments by keyword instead costs ~2.3 µs
against ~0.6 in order, of ~8.5 µs of Python work in a short call (measured on a CPU, 30 parameters).
"""

from __future__ import annotations

import itertools

import torch

from kernels_triton._kept import kept
from kernels_triton._launch import DirectLauncher, replaced
from kernels_triton._util import cdiv
from kernels_triton.gdn import cut, streams
from kernels_triton.gdn.common import MAX_HEAD_DIM, check_head_dims, gate_rows, grid_rows
from kernels_triton.gdn.metadata import CHUNK, GdnChunkMetadata, chunk_bounds_on_device, tensor_version
from kernels_triton.gdn.plan import OUTPUT_OPTIONS, Plan, plan_for, segment_cuts, sequence_groups
from kernels_triton.gdn.prepare import PrepareArgs, _chunk_prepare_kernel
from kernels_triton.gdn.scan import (
    OutputArgs,
    ScanArgs,
    SingleArgs,
    _chunk_output_kernel,
    _chunk_scan_kernel,
    _chunk_single_kernel,
)

launch_prepare = DirectLauncher(_chunk_prepare_kernel)
launch_scan = DirectLauncher(_chunk_scan_kernel)
launch_single = DirectLauncher(_chunk_single_kernel)
launch_output = DirectLauncher(_chunk_output_kernel)
_args = tuple.__new__  # _args(XArgs, values): a launch's named tuple from its values in field order, at C speed


def gdn_chunk_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    state_pool: torch.Tensor | None = None,
    state_slots: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    metadata: object | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton implementation of :func:`qwen35.ops.gdn_chunk_prefill` (see :mod:`kernels_triton.gdn`).

    ``chunk_size`` is accepted for the façade's signature: this backend always uses ``CHUNK``-token chunks (the
    result does not depend on the chunk size beyond rounding). ``metadata``: from :func:`prepare_gdn_metadata` for
    this batch's ``cu_seqlens`` (built here, on the device, when not given)."""
    return prefill(q, k, v, g, beta, a, b, A_log, dt_bias, cu_seqlens, initial_state, state_pool, state_slots,
                   has_initial_state, output_final_state, scale, use_qk_l2norm, metadata, out, None)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor | None,
            a: torch.Tensor | None, b: torch.Tensor | None, A_log: torch.Tensor | None, dt_bias: torch.Tensor | None,
            cu_seqlens: torch.Tensor | None, initial_state: torch.Tensor | None, state_pool: torch.Tensor | None,
            state_slots: torch.Tensor | None, has_initial_state: torch.Tensor | None, output_final_state: bool,
            scale: float | None, use_qk_l2norm: bool, metadata: object | None, out: torch.Tensor | None,
            configs: tuple[dict | None, dict | None] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`gdn_chunk_prefill` with every argument in order; ``configs``: (prepare, scan) configs forced over the
    plan's (:meth:`Plan.with_configs`, for :mod:`kernels_triton.gdn.bench_api`; they also turn off the
    single-launch path), None for the op's own."""
    T, H, K = q.shape
    _, HV, V = v.shape
    if K > MAX_HEAD_DIM or V > MAX_HEAD_DIM:
        check_head_dims(K, V)
    dev = q.device
    if (q.data_ptr() | k.data_ptr()) & 15:
        # The scan stages q and k through pipelined (asynchronous) copies; from views that are not
        # 16-byte aligned these read wrong rows on an H200 (seen with a 2-byte offset), so realign.
        q, k = q.clone(), k.clone()
    for name, st in (("initial_state", initial_state), ("state_pool", state_pool)):
        if st is not None and st.dtype is not torch.float32 and st.dtype is not torch.float64:
            raise ValueError(f"{name} has dtype {st.dtype}; states are fp32 (fp64 accepted)")
    g, beta, a, b, gate_stride = gate_rows(g, beta, a, b)
    scale = K**-0.5 if scale is None else float(scale)
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if varlen else 1
    # Every sequence within one chunk: both phases in one launch, no chunk table (short prompts are host-bound).
    # Not for bf16 with V < 64: its scan tile would be one of the miscompiled class (plan.miscompiled_scan).
    single = 0 < T <= CHUNK and N > 0 and configs is None and (V >= 64 or q.dtype != torch.bfloat16)
    bounds, num_chunks = _chunk_table(metadata, cu_seqlens, T, N, single) if varlen else (None, cdiv(T, CHUNK))
    plan = plan_for(dev, q.dtype, N, HV, K, V, 1 << max(T // max(N, 1), 1).bit_length() - 1)
    if configs is not None:
        plan = plan.with_configs(dev, q.dtype, *configs)
    pool = state_pool is not None
    pool_slot_stride = state_pool.stride(0) if pool else HV * K * V
    raw = a is not None
    if single:  # both phases in one launch; each of its programs has its own copy of the workspace
        copies = cdiv(V, plan.single.BV)
        ws = _single_workspace(copies * HV * T * plan.ws_row, plan.ws_dtype, dev)
        o = torch.empty(T, HV, V, dtype=q.dtype, device=dev) if out is None else out
        h0, ht, final = _state_io(initial_state, state_pool, output_final_state, N, HV, K, V, dev)
        launch_single((N * HV, copies), _args(SingleArgs, (
            q, k, v, g, beta, a, b, A_log, dt_bias, ws, o, cu_seqlens, h0, ht, state_slots, has_initial_state, T, scale,
            pool_slot_stride, HV * T * plan.ws_row, H, HV, gate_stride, varlen, raw, use_qk_l2norm, h0 is not None,
            ht is not None, pool, has_initial_state is not None, *plan.single)), plan.single_options)
        return o, final
    ws = torch.empty(HV * T * plan.ws_row, dtype=plan.ws_dtype, device=dev)  # layout: prepare.workspace
    work = num_chunks > 0 and T > 0
    # The cut-and-correct path (a plan option, off by default): its segments need the batch's offsets on the host.
    segs = cut.segment_table(metadata, cu_seqlens, T, plan.cut, dev) if plan.cut and work else None
    # One long sequence in parts (segments): each part's prepare (seg_prepare) and output (split scans) run beside a
    # scan part.
    parted = dev.type != "cuda" or streams.driver() is not None
    cuts = (segment_cuts(num_chunks, plan.segments, ratio=plan.segment_ratio)
            if work and N == 1 and plan.segments > 1 and parted else None)
    # A batch of sequences (one-pass scans) in groups of whole sequences, the same way: each group's prepare beside the
    # scan of the group before. Needs the chunk table's sequence offsets on the host (metadata built from them).
    seq_cuts = None
    if (work and N > 1 and plan.groups > 1 and not plan.split and parted and isinstance(metadata, GdnChunkMetadata)
            and metadata.chunk_offsets is not None and bounds is metadata.chunk_bounds):
        seq_cuts = sequence_groups(metadata.chunk_offsets, plan.groups)
        cuts = [metadata.chunk_offsets[s] for s in seq_cuts]
    prepare_args = None
    if work:
        prepare_args = _args(PrepareArgs, (q, k, v, g, beta, a, b, A_log, dt_bias, bounds, ws, T, scale, 0, H, HV,
                                           gate_stride, varlen, raw, use_qk_l2norm, *plan.prepare))
        # Phase 1: everything that does not need the running state, all chunks in parallel (in parts, with
        # seg_prepare: the first part's chunks). Launched before the other allocations: the GPU starts on it
        # while the host does them.
        first = cuts[1] if cuts is not None and plan.seg_prepare else num_chunks
        launch_prepare((first * HV,), prepare_args, plan.prepare_options)
    o = torch.empty(T, HV, V, dtype=q.dtype, device=dev) if out is None else out
    h0, ht, final = _state_io(initial_state, state_pool, output_final_state, N, HV, K, V, dev)

    # Phase 2: the sequential pass over chunks, state in registers, output and final state written (split: the
    # chunks' starting states and V' written instead, and the output computed from them with all chunks in parallel).
    split = plan.split and work
    states = torch.empty(num_chunks, HV, K, V, dtype=plan.ws_dtype, device=dev) if split else None
    scan_args = _args(ScanArgs, (q, k, v, ws, o, states, cu_seqlens, h0, ht, state_slots, has_initial_state, None, T,
                                 pool_slot_stride, 0, 0, 0, H, HV, N * HV, varlen, h0 is not None, ht is not None, pool,
                                 has_initial_state is not None, split, False, False, False, *plan.scan))
    if segs is not None:
        cut.run(plan, *segs, scan_args, N, HV)
        return o, final
    output_args = (_args(OutputArgs, (q, ws, states, o, bounds, T, H, HV, 0, varlen, *plan.output))
                   if split else None)
    if cuts is not None and len(cuts) > 2:
        scans = (_group_scans(plan, seq_cuts, HV, scan_args) if seq_cuts is not None
                 else _segment_scans(plan, cuts, HV, scan_args))
        scan_in_parts(plan, cuts, scans, HV, prepare_args, output_args)
        return o, final
    if N > 0:
        launch_scan(plan.scan_grid(N, HV), scan_args, plan.scan_options)
    if split:
        launch_output((num_chunks * HV, cdiv(V, plan.output.BV)), output_args, OUTPUT_OPTIONS)
    return o, final


def _chunk_table(metadata: object | None, cu_seqlens: torch.Tensor, T: int, N: int,
                 single: bool) -> tuple[torch.Tensor | None, int]:
    """(chunk table on the device, chunks) of a varlen batch: the metadata's, or built on the device where there is
    none or ``cu_seqlens`` was written in place since; none for the single-launch path (N programs' worth)."""
    if isinstance(metadata, GdnChunkMetadata):
        mcu = metadata.cu_seqlens
        if mcu is not cu_seqlens and (mcu.data_ptr() != cu_seqlens.data_ptr() or mcu.shape[0] != N + 1):
            raise ValueError("metadata was prepared for another cu_seqlens tensor; call prepare_gdn_metadata "
                             "on this batch's cu_seqlens")
        if single:
            return None, N
        if metadata.version == tensor_version(cu_seqlens):
            return metadata.chunk_bounds, metadata.num_chunks
        return chunk_bounds_on_device(cu_seqlens, T) if N > 0 else (None, 0)  # written in place: may be stale
    if metadata is None:
        return chunk_bounds_on_device(cu_seqlens, T) if N > 0 and not single else (None, N)
    raise ValueError(f"metadata must come from kernels_triton.prepare_gdn_metadata, got {type(metadata)}")


def _state_io(initial_state: torch.Tensor | None, state_pool: torch.Tensor | None, output_final_state: bool, N: int,
              HV: int, K: int, V: int, device: torch.device) -> tuple:
    """(states read, states written, the final states returned): the pool both ways, else the initial states and a
    new ``[N, HV, K, V]`` fp32 tensor when the caller asks for the final states."""
    if state_pool is not None:
        return state_pool, state_pool, None
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if output_final_state else None
    return initial_state, final, final


def _single_workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The single-launch path's workspace (T <= CHUNK: at most a few MB): one buffer per thread, device, stream and
    dtype, kept between calls (:func:`kernels_triton._kept.kept`; measured: an allocation is 1-4 µs of a short
    prefill's 30-55 µs of host time on the H200's host). Under a CUDA-graph capture a new allocation, the graph's
    own."""
    record = kept("gdn_single", numel, dtype, device)
    return torch.empty(numel, dtype=dtype, device=device) if record is None else record.buffer


# ----------------------------------------------------------------------------- a call in parts


def _segment_scans(plan: Plan, cuts: list[int], HV: int, scan_args: ScanArgs) -> list[tuple[tuple, ScanArgs]]:
    """(grid, arguments) of each scan part of one sequence in segments (chunk bounds ``cuts``): the state goes from
    part to part in an fp32 tensor."""
    carry = torch.empty(HV, plan.scan.K, plan.scan.V, dtype=torch.float32, device=scan_args.q_ptr.device)
    grid, parts = plan.scan_grid(1, HV), len(cuts) - 1
    return [(grid, replaced(scan_args, carry_ptr=carry, chunk_lo=cuts[i], chunk_hi=cuts[i + 1], PART=True,
                            CARRY_IN=i > 0, CARRY_OUT=i < parts - 1)) for i in range(parts)]


def _group_scans(plan: Plan, seq_cuts: list[int], HV: int, scan_args: ScanArgs) -> list[tuple[tuple, ScanArgs]]:
    """(grid, arguments) of each scan part of a batch in groups of whole sequences (bounds ``seq_cuts``,
    :func:`~kernels_triton.gdn.plan.sequence_groups`): the (sequence, head) pairs of each group."""
    n_vb = plan.scan_grid(1, HV)[0]
    return [((n_vb, *grid_rows((hi - lo) * HV)), replaced(scan_args, nh_base=lo * HV, NH=hi * HV))
            for lo, hi in itertools.pairwise(seq_cuts)]


def scan_in_parts(plan: Plan, cuts: list[int], scans: list[tuple[tuple, ScanArgs]], HV: int,
                  prepare_args: PrepareArgs, output_args: OutputArgs | None) -> None:
    """Phase 2 in parts: scan launch i (``scans[i]``: grid, arguments) covers the chunks ``cuts[i] .. cuts[i + 1]``
    (one sequence's segments, :func:`_segment_scans`, or groups of sequences, :func:`_group_scans`), after the
    caller launched the prepare of every chunk or (``seg_prepare``) of the first part's. On a GPU the scan parts run
    in order on a high-priority stream; beside scan part i run, on the caller's stream, the output of part i - 1
    (split scans) and, with ``seg_prepare``, on a third stream the prepares of the parts after it (each scan part
    waits for its own). Launches are issued in the order the scan chain needs them (a launch costs the host ~20 µs).
    The caller's stream ends after every part (events only: nothing else to synchronise, and CUDA-graph capture
    sees forks and joins)."""
    dev = prepare_args.q_ptr.device
    parts = len(cuts) - 1
    gpu = dev.type == "cuda"
    n_out = cdiv(plan.scan.V, plan.output.BV) if plan.split else 0
    if gpu:
        d = dev.index
        side, prep = streams.side_streams(dev)
        main, raw_side, raw_prep = torch._C._cuda_getCurrentRawStream(d), side.cuda_stream, prep.cuda_stream
        forked, prep_done = streams.event(d, 2 * parts), streams.event(d, 2 * parts + 1)
        streams.record(forked, main)  # after the caller's work and the first prepare
        streams.wait(raw_side, forked)
        if plan.seg_prepare:
            streams.wait(raw_prep, forked)

    def prepare(i: int) -> None:
        launch_prepare(((cuts[i + 1] - cuts[i]) * HV,), replaced(prepare_args, chunk_base=cuts[i]),
                       plan.prepare_options, prep if gpu else None)
        if gpu:
            streams.record(streams.event(d, parts + i), raw_prep)

    def output(i: int) -> None:
        if gpu:
            streams.wait(main, streams.event(d, i))  # output part i (and the caller's later work) after scan part i
        if plan.split:  # (the one-pass scan wrote the output itself)
            launch_output(((cuts[i + 1] - cuts[i]) * HV, n_out), replaced(output_args, chunk_base=cuts[i]),
                          OUTPUT_OPTIONS)

    for i, (grid, sa) in enumerate(scans):
        if gpu:
            if plan.seg_prepare and i > 0:
                streams.wait(raw_side, streams.event(d, parts + i))  # scan part i after its prepare
            launch_scan(grid, sa, plan.scan_options, side)
            streams.record(streams.event(d, i), raw_side)
        else:
            launch_scan(grid, sa, plan.scan_options)
        if plan.seg_prepare and i + 1 < parts:
            prepare(i + 1)  # runs beside scan part i (issued after it: the host's launches lag the GPU at first)
        if i > 0:
            output(i - 1)
    output(parts - 1)
    if gpu and plan.seg_prepare:  # an explicit join of the prepare stream (graph capture wants every fork joined)
        streams.record(prep_done, raw_prep)
        streams.wait(main, prep_done)
