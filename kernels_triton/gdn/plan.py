"""Launch plans of the chunked prefill: workspace dtype, the prepare and scan configs (tuned entry or heuristic),
how a long sequence or a batch is cut into parts, all fixed per (device, dtype, sequences, heads, head dims, tokens
per sequence) and computed once, so that a call's host work is allocations and launches.

The heuristics' measured figures are in tuning/notes_gdn.md; each choice below quotes one.
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kernels_triton import _config
from kernels_triton._config import device_facts
from kernels_triton._util import cdiv, pow2
from kernels_triton.gdn import cut as cut_path
from kernels_triton.gdn.common import grid_rows
from kernels_triton.gdn.metadata import CHUNK
from kernels_triton.gdn.prepare import PrepareConsts
from kernels_triton.gdn.scan import OutputConsts, ScanConsts, SingleConsts

BF16_MIN_HEAD_DIM = 32  # bf16 prepare tiles narrower than this many columns (64 bytes a row) are miscompiled
SPLIT_MAX_PAIRS = 16  # (sequence, head) pairs up to which long sequences take the split scan
SPLIT_MIN_TOKENS = 1024  # ... from this many tokens per sequence
SEGMENT_TOKENS = 8192  # tokens per part of one sequence scanned in parts
MAX_SEGMENTS = 6
GROUPS_MIN_HEADS = 32  # a batch of long sequences scans in groups of sequences from this many value heads
OUTPUT_OPTIONS = {"num_warps": 4, "num_stages": 1}  # the split scan's output launch
# Relative lengths of the first, middle and last parts of a split scan (see segment_cuts)
SEGMENT_WEIGHTS = (1.0, 1.0, 0.5)
# The one-pass scan's parts: each part this much of the one before (see segment_cuts), by the scan's V block; other
# BVs 0.6. Measured on the H200: at BV 64 equal parts, at BV 32 0.6 fastest (tuning/notes_gdn.md).
ONE_PASS_SEGMENT_RATIO: dict[int, float] = {32: 0.6, 64: 1.0}


def workspace_dtype(dtype: torch.dtype, device: torch.device, K: int = 128, V: int = 128) -> tuple[torch.dtype, str]:
    """(workspace / dot-operand dtype, dot input precision) for an activation dtype and head dims.

    fp32 inputs get fp32-accurate dots: three tf32 passes on GPUs that have tf32 (``ieee`` FMA dots need too many
    registers for these tiles), plain fp32 elsewhere. fp16 takes the fp32 workspace (an fp16 one could overflow) with
    tf32 dots. bf16 with a head dim under ``BF16_MIN_HEAD_DIM`` does too: Triton 3.6 builds the one-stage prepare
    kernel wrong on bf16 tiles of 16 columns (an illegal address or output errors of 0.01-1.1 on the H200, where the
    fp32 workspace gave 1.1e-3; tuning/notes_gdn.md); no Qwen3.5 size is near (K = V = 128), the tiny test models
    have 32.
    """
    if dtype == torch.bfloat16:
        if min(K, V) < BF16_MIN_HEAD_DIM:
            return torch.float32, "tf32"
        return torch.bfloat16, "tf32"
    if dtype == torch.float16:
        return torch.float32, "tf32"
    if dtype == torch.float32:
        tf32 = device_facts(device)[2] >= (8, 0)
        return torch.float32, "tf32x3" if tf32 else "ieee"
    raise ValueError(f"triton GDN kernels take fp16, bf16 or fp32 activations, got {dtype}")


# ----------------------------------------------------------------------------- scan config


@_config.derived
@functools.lru_cache(maxsize=1024)
def scan_config(device: torch.device, N: int, HV: int, K: int, V: int, per_seq: int, dtype: torch.dtype) -> dict:
    """Phase-2 launch config: a tuned file entry if present, else the rule below. Cached: the caller rounds
    ``per_seq`` (tokens per sequence) down to a power of two.

    - At most SPLIT_MAX_PAIRS (sequence, head) pairs and sequences of >= SPLIT_MIN_TOKENS: the scan is latency-bound
      and its output dots take half its time, so it walks the state path alone (``SPLIT``, 16-wide V blocks, as
      many stages as shared memory allows) and a parallel launch computes the output (measured on the H200:
      397B-TP8 1x32768 0.79 against 0.95 ms; from 32 pairs on the states' traffic costs more than that saves).
    - Else the one-pass scan: from 16 pairs on, 64-wide V blocks once they make at least half as many programs as
      there are SMs, else 32 (measured: 35B-A3B 1x32768, 32 pairs, 0.98 ms at BV 64, 0.82 at 32); 16-wide below 16
      pairs. 3 stages as far as shared memory allows (measured: 27B-TP1 1x32768 1.01 against 1.27 ms with 2).
    - One sequence of >= 2 * SEGMENT_TOKENS runs in parts (``SEGMENTS``, :func:`segment_parts`), each part's
      prepare (``SEG_PREPARE``) and output beside the scan of the part before / after it (measured: 397B-TP8 1x32768
      0.63 against 0.75 ms in one part, 35B-A3B 1x32768 1.42 against 1.56, by graph replay).
    - Several sequences of >= SEGMENT_TOKENS at >= GROUPS_MIN_HEADS value heads run in two groups of whole sequences,
      the second group's prepare beside the first group's scan (``GROUPS``; measured: 27B-TP1 2x16384 2.05 against 2.23
      ms; slower at 12 or 8 value heads).

    tuning/notes_gdn.md has the sweeps. A chosen config is moved off the class Triton 3.6 builds wrong
    (:func:`avoid_miscompiled_scan`).
    """
    if device.type != "cuda":  # the interpreter: fewest programs is fastest
        return {"BV": pow2(V, 16), "num_warps": 4, "num_stages": 1}
    tuned = _config.lookup("gdn_chunk_scan", device_facts(device)[0],
                           f"HV={HV},V={V},dtype={str(dtype).replace('torch.', '')}", tokens=per_seq,
                           fields=("BV", "num_warps", "num_stages"))
    if tuned:
        return avoid_miscompiled_scan(dict(tuned), dtype, V)
    pairs = N * HV
    smem = shared_memory_per_block(device) * 128 // max(pow2(K, 16), 128)  # the tiles grow with K beyond 128
    if pairs <= SPLIT_MAX_PAIRS and per_seq >= SPLIT_MIN_TOKENS and V >= 64:
        # Shared memory of the split scan at BV 16 (sm_90 builds, K = 128): bf16 108 / 143 KB at 3 / 4 stages
        # (2: ~72); fp16 ~106 / 144 KB at 2 / 3; fp32 ~144 / 214 KB at 2 / 3.
        if dtype == torch.bfloat16:  # never one stage: miscompiled_scan
            stages = 4 if smem >= 150_000 else 3 if smem >= 115_000 else 2
        else:
            two, three = (110_000, 150_000) if dtype == torch.float16 else (150_000, 220_000)
            stages = 3 if smem >= three else 2 if smem >= two else 1
        parts = segment_parts(N, per_seq)
        return {"BV": 16, "num_warps": 4, "num_stages": stages, "SPLIT": True, "SEGMENTS": parts,
                "SEG_PREPARE": parts > 1}
    if pairs >= 16:
        BV = 64 if 2 * pairs * cdiv(V, 64) >= device_facts(device)[1] else 32
    else:
        BV = 16
    BV = min(pow2(V, 16), BV)
    # Shared memory of the pipelined loads (sm_90 builds, K = 128): bf16 at BV 64 takes 74 / 140 / 206 KB
    # with 1 / 2 / 3 stages; the fp32 workspace (fp16 and fp32 inputs) 82 / 197 / 329 KB at most.
    if dtype == torch.bfloat16:
        stages = 3 if smem >= 210_000 else 2 if smem >= 145_000 else 1
    else:
        stages = 2 if smem >= 200_000 else 1
    parts = segment_parts(N, per_seq)
    if parts > 1:
        return avoid_miscompiled_scan({"BV": BV, "num_warps": 4, "num_stages": stages, "SEGMENTS": parts,
                                       "SEG_PREPARE": True}, dtype, V)
    if N > 1 and HV >= GROUPS_MIN_HEADS and per_seq >= SEGMENT_TOKENS:
        return avoid_miscompiled_scan({"BV": BV, "num_warps": 4, "num_stages": stages, "GROUPS": 2,
                                       "SEG_PREPARE": True}, dtype, V)
    return avoid_miscompiled_scan({"BV": BV, "num_warps": 4, "num_stages": stages}, dtype, V)


def segment_parts(N: int, per_seq: int) -> int:
    """Parts of one sequence's scan (both scan forms, see :func:`scan_config`): one per SEGMENT_TOKENS, at most
    MAX_SEGMENTS (a part costs the host ~100 µs of launches and events); a batch of several sequences runs in one
    part."""
    return max(1, min(MAX_SEGMENTS, per_seq // SEGMENT_TOKENS)) if N == 1 else 1


def scan_t_fits(K: int, V: int, split: bool) -> bool:
    """Whether ``T diag(beta)`` (``[C, C]`` per chunk and head, ``SCAN_T``) fits the workspace where W and U go: both
    parts in the one-pass scan, W's alone in the split scan (which writes ``V'`` into U's)."""
    return K >= CHUNK if split else K + V >= CHUNK


def default_scan_t(split: bool) -> bool:
    """``SCAN_T`` where no tuned entry sets it: the prepare leaves ``T diag(beta)`` and the one-pass scan forms ``V'``
    itself (measured on the H200: 27B-TP1 8x4096 1.67 against 1.88 ms, the prepare 27 % shorter, output errors the same
    or lower). The split scan keeps W and U: its latency-bound state path got slower with the extra dot
    (tuning/notes_gdn.md)."""
    return not split


def miscompiled_scan(dtype: torch.dtype, BV: int, stages: int) -> bool:
    """Whether Triton 3.6 builds a wrong scan for this config on a GPU: with the bf16 workspace, one pipeline stage
    and V blocks narrower than 64 (tiles of fewer than 128 bytes per row), the H200 gave wrong output (BV 32:
    rel. error 1.2) or an out-of-range shared-memory address (BV 16) in the ``Aqk V'`` dot; two or three stages,
    BV 64, and the fp32 workspace (fp16, fp32 inputs) at every BV were right (tuning/notes_gdn.md)."""
    return dtype == torch.bfloat16 and stages < 2 and BV < 64


def avoid_miscompiled_scan(cfg: dict, dtype: torch.dtype, V: int) -> dict:
    """A chosen config moved off :func:`miscompiled_scan`: 64-wide blocks where V has them, else two stages (a
    device without the shared memory for them then fails to launch, loudly, instead of computing garbage)."""
    if miscompiled_scan(dtype, cfg["BV"], cfg["num_stages"]):
        if V >= 64:
            cfg["BV"] = 64
        else:
            cfg["num_stages"] = 2
    return cfg


@functools.cache
def shared_memory_per_block(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


# ----------------------------------------------------------------------------- the tuner's search space

# What a tuned ``gdn_chunk_scan`` entry may set (the lookup in :func:`scan_config` reads these keys only; a tuned
# entry runs the one-pass scan), every value the tuner may try. Pruned per shape and device by
# :func:`scan_excluded`.
SCAN_SEARCH_SPACE: dict[str, tuple[int, ...]] = {"BV": (16, 32, 64, 128), "num_warps": (2, 4, 8),
                                                 "num_stages": (1, 2, 3, 4)}
SCAN_SPACE_HASH = _config.declare_search_space(("gdn_chunk_scan",), {"space": SCAN_SEARCH_SPACE, "rules": 1})
MAX_STATE_REGS = 128  # fp32 registers per thread for the program's [BK, BV] state tile


def scan_shared_bytes(K: int, BV: int, stages: int, dtype: torch.dtype, V: int = 128) -> int:
    """A lower bound of the one-pass scan's shared memory: per pipeline stage one chunk of q and k (input dtype),
    of W ([C, BK]) and of U ([C, BV]) in the workspace dtype (sm_90 builds at K = 128 measure 74 / 140 / 206 KB for
    1 / 2 / 3 stages with bf16, this gives 57 / 115 / 172)."""
    ws = 2 if dtype == torch.bfloat16 and min(K, V) >= BF16_MIN_HEAD_DIM else 4
    per_stage = CHUNK * pow2(K, 16) * (2 * torch.empty((), dtype=dtype).element_size() + ws) + CHUNK * BV * ws
    return max(stages, 1) * per_stage


def scan_excluded(cfg: dict, K: int, V: int, dtype: torch.dtype, limits: _config.DeviceLimits) -> str | None:
    """Why a scan config is outside the search space for these head dims on a device with ``limits``, or None: a
    value not in :data:`SCAN_SEARCH_SPACE`, V blocks wider than V, a state tile over :data:`MAX_STATE_REGS`
    registers per thread, more threads or (by :func:`scan_shared_bytes`) shared memory than the device has, or on a
    GPU the class Triton 3.6 builds wrong (:func:`miscompiled_scan`)."""
    for key, values in SCAN_SEARCH_SPACE.items():
        if cfg.get(key) not in values:
            return f"{key}={cfg.get(key)} is not in {values}"
    BV, warps, stages = cfg["BV"], cfg["num_warps"], cfg["num_stages"]
    if BV > pow2(V, 16):
        return f"BV={BV} is wider than V={V}"
    regs = pow2(K, 16) * BV // (32 * warps)
    if regs > MAX_STATE_REGS:
        return f"{regs} state registers per thread > {MAX_STATE_REGS}"
    if limits.max_threads is not None and 32 * warps > limits.max_threads:
        return f"{32 * warps} threads > {limits.max_threads} per block"
    need = scan_shared_bytes(K, BV, stages, dtype, V)
    if limits.shared_memory is not None and need > limits.shared_memory:
        return f"at least {need} bytes of shared memory > {limits.shared_memory}"
    if limits.capability is not None and miscompiled_scan(dtype, BV, stages):
        return f"bf16 with BV={BV} in one stage: Triton 3.6 builds it wrong (miscompiled_scan)"
    return None


def scan_search_space(K: int, V: int, dtype: torch.dtype, limits: _config.DeviceLimits) -> list[dict]:
    """Every scan config of :data:`SCAN_SEARCH_SPACE` that :func:`scan_excluded` keeps."""
    keys = tuple(SCAN_SEARCH_SPACE)
    cands = (dict(zip(keys, values, strict=True)) for values in itertools.product(*SCAN_SEARCH_SPACE.values()))
    return [c for c in cands if scan_excluded(c, K, V, dtype, limits) is None]


# ----------------------------------------------------------------------------- prepare config


@functools.lru_cache(maxsize=64)
def prepare_config(device: torch.device, dtype: torch.dtype) -> tuple[dict, dict]:
    """(kernel flags ``DIAG_ROWS``, ``BLOCK_INV``, ``SCALE_K``; launch options) of the prepare kernel.

    The diagonal inverse stays exact in fp32 for every dtype (:mod:`.inverse`). bf16 and fp16 on sm80+ invert 4-row
    diagonal blocks by substitution (3 dependent steps) and merge them 4 -> 8 -> ... -> 64 in tf32 dots, the merges
    up to 16 rows on the diagonal blocks only (``BLOCK_INV``), and form ``W`` from ``T diag(beta)`` (``SCALE_K``);
    bf16 caps registers at 168 (three programs per SM instead of two). fp32 (tf32x3 merges) and pre-sm80 GPUs (no
    tf32) keep 16-row substitution on the full tile. Measured on the H200: 4-row blocks 1.31 against 1.92 ms at
    27B-TP1 1x32768, then ``BLOCK_INV`` 1.09 against 1.31 and ``SCALE_K`` 1.06 against 1.09 ms at 27B-TP1 8x4096,
    output errors the same on the hard keys (tuning/notes_gdn.md).
    """
    tf32 = device_facts(device)[2] >= (8, 0)
    four_rows = tf32 and dtype in (torch.bfloat16, torch.float16)
    flags = {"DIAG_ROWS": 4 if four_rows else 16, "BLOCK_INV": 1 if four_rows else 0, "SCALE_K": four_rows}
    options = {"num_warps": 4, "num_stages": 1}
    if dtype == torch.bfloat16 and tf32:
        options["maxnreg"] = 168
    return flags, options


# ----------------------------------------------------------------------------- parts


def segment_cuts(num_chunks: int, parts: int, weights: tuple[float, float, float] | None = None,
                 ratio: float | None = None) -> list[int]:
    """Chunk bounds of ``parts`` segments of a sequence. Lengths in the ratio ``weights`` (first, every middle one,
    last; default :data:`SEGMENT_WEIGHTS`): the last part's output has no scan part beside it, so it is shorter,
    while part 1's prepare must finish beside scan part 0. Or, with ``ratio``, each part ``ratio`` times the one
    before: a prepare beside a scan part runs slower than alone, so to be done when the scan part before it ends it
    must cover fewer chunks than that part. Strictly increasing: fewer parts where the sequence has too few chunks
    for them (no empty launch)."""
    if ratio is not None:
        w = [ratio**i for i in range(parts)]
    else:
        first, middle, last = SEGMENT_WEIGHTS if weights is None else weights
        w = [first] + [middle] * (parts - 2) + [last] if parts > 1 else [1.0]
    total, acc, cuts = sum(w), 0.0, [0]
    for x in w[:-1]:
        acc += x
        cuts.append(round(num_chunks * acc / total))
    cuts.append(num_chunks)
    return sorted(set(cuts))


def sequence_groups(chunk_offs: Sequence[int], groups: int, ratio: float | None = 1.0) -> list[int]:
    """Sequence bounds ``[0, .., N]`` of at most ``groups`` groups of whole sequences (``chunk_offs``: each sequence's
    first chunk, then the total, :func:`~kernels_triton.gdn.metadata.chunk_offsets`), cut at the sequence boundaries
    nearest to :func:`segment_cuts`' chunk bounds (lengths shrinking by ``ratio``; default equal, which measured
    faster than 0.6 for groups); every group holds at least one chunk."""
    n, N = chunk_offs[-1], len(chunk_offs) - 1
    cuts = [0]
    for target in segment_cuts(n, groups, ratio=ratio)[1:-1]:
        s = bisect.bisect_left(chunk_offs, target)  # chunk_offs[s - 1] < target <= chunk_offs[s]
        if s > 0 and target - chunk_offs[s - 1] < chunk_offs[s] - target:
            s -= 1
        if chunk_offs[cuts[-1]] < chunk_offs[s] < n:
            cuts.append(s)
    cuts.append(N)
    return cuts


# ----------------------------------------------------------------------------- the plan

PREPARE_FLAGS = ("DIAG_ROWS", "BLOCK_INV", "SCALE_K")  # prepare kernel flags a forced config may set
PREPARE_BLOCKS = ("BKC", "BVC")  # the prepare's column blocks
SCAN_FLAGS = ("SPLIT", "SEGMENTS", "SEG_PREPARE", "GROUPS", "SCAN_T")  # scan-config keys that are not launch options
CUT_FLAGS = ("CUT", "CUT_BV")  # the cut-and-correct path (kernels_triton.gdn.cut): off unless a forced config sets CUT
LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg")


class Plan(NamedTuple):
    """Everything about a call that depends only on (device, dtype, sequences, heads, head dims, tokens per
    sequence rounded to a power of two). The ``*_consts`` fields are the kernels' plan-dependent arguments, by name
    (:func:`kernels_triton._launch.launch_args`)."""

    ws_dtype: torch.dtype
    ws_row: int  # workspace elements per (value head, token), see prepare.workspace
    prepare: PrepareConsts
    prepare_options: dict
    scan: ScanConsts
    scan_options: dict
    output: OutputConsts  # the split scan's output launch (64-wide V blocks at most)
    single: SingleConsts  # both phases in one launch (batches of at most CHUNK tokens)
    single_options: dict  # the prepare's without its register cap (few programs)
    split: bool = False  # the scan's state path alone, then the output of all chunks in parallel (SPLIT)
    segments: int = 1  # one sequence in this many parts, overlapping launches (SEGMENTS)
    seg_prepare: bool = False  # parts: the prepare in parts too (SEG_PREPARE)
    groups: int = 1  # a batch of one-pass scans in this many groups of sequences, overlapping launches (GROUPS)
    cut: int = 0  # the cut-and-correct path with segments of this many chunks (CUT; 0: off), see .cut
    cut_bv: int = 32  # its local pass' column block (CUT_BV)

    @property
    def segment_ratio(self) -> float | None:
        """:func:`segment_cuts`' ``ratio`` for one sequence's parts: by the one-pass scan's V block
        (:data:`ONE_PASS_SEGMENT_RATIO`), None (its weights) for the split scan."""
        return None if self.split else ONE_PASS_SEGMENT_RATIO.get(self.scan.BV, 0.6)

    def scan_grid(self, N: int, HV: int) -> tuple[int, int, int]:
        return (cdiv(self.scan.V, self.scan.BV), *grid_rows(N * HV))

    def with_configs(self, device: torch.device, dtype: torch.dtype, prepare: dict | None,
                     scan: dict | None) -> Plan:
        """This plan with forced launch configs (benchmarks and tests: :mod:`kernels_triton.gdn.bench_api`).

        ``prepare``: launch options (``num_warps``, ``num_stages`` (1 only), ``maxnreg``), the column blocks ``BKC`` /
        ``BVC`` and the kernel flags ``DIAG_ROWS`` (4, 8, 16), ``BLOCK_INV`` (0, 1), ``SCALE_K``, over the default
        ones. ``scan``: ``BV`` and launch options, ``SPLIT``, ``SEGMENTS``, ``SEG_PREPARE``, ``GROUPS`` and
        ``SCAN_T`` (off unless set), replacing the default scan config; ``CUT`` (chunks per segment) and ``CUT_BV``
        take the cut-and-correct path (:mod:`kernels_triton.gdn.cut`; ``BV`` and the launch options are then its
        output pass')."""
        plan = self
        if prepare is not None:
            _check_keys("prepare", prepare, PREPARE_FLAGS + PREPARE_BLOCKS + LAUNCH_OPTIONS)
            if prepare.get("num_stages", 1) != 1:
                raise ValueError(f"prepare config num_stages={prepare['num_stages']}: accepted 1 (its loops are not "
                                 "pipelined; Triton 3.6 gave wrong output with 2 stages on an H200)")
            flags = {k: prepare.get(k, getattr(plan.prepare, k)) for k in PREPARE_FLAGS}
            if flags["DIAG_ROWS"] not in (4, 8, 16):
                raise ValueError(f"prepare config DIAG_ROWS={flags['DIAG_ROWS']}: accepted 4, 8 or 16")
            if flags["BLOCK_INV"] not in (0, 1):
                raise ValueError(f"prepare config BLOCK_INV={flags['BLOCK_INV']}: accepted 0 (merges on the full "
                                 "tile) or 1 (merges up to 16 rows on the diagonal blocks)")
            BKC, BVC = prepare.get("BKC", plan.prepare.BKC), prepare.get("BVC", plan.prepare.BVC)
            if not all(b in (16, 32, 64) for b in (BKC, BVC)):
                raise ValueError(f"prepare config BKC={BKC}, BVC={BVC}: accepted 16, 32 or 64")
            options = {**plan.prepare_options, **{k: v for k, v in prepare.items() if k in LAUNCH_OPTIONS}}
            plan = plan._replace(prepare=plan.prepare._replace(BKC=BKC, BVC=BVC, **flags), prepare_options=options)
        if scan is not None:
            _check_keys("scan", scan, ("BV", *SCAN_FLAGS, *CUT_FLAGS, *LAUNCH_OPTIONS))
            if "BV" not in scan:
                raise ValueError(f"scan config {scan}: BV is required")
            if device.type == "cuda" and miscompiled_scan(dtype, scan["BV"], scan.get("num_stages", 3)):
                raise ValueError(f"scan config {scan}: bf16 scans need num_stages >= 2 or BV >= 64 on a GPU "
                                 "(Triton 3.6 builds a wrong kernel for narrower blocks in one stage)")
            K, V, C = plan.scan.K, plan.scan.V, plan.scan.C
            split = scan.get("SPLIT", False)
            segments = scan.get("SEGMENTS", 1)
            seg_prepare = scan.get("SEG_PREPARE", False)
            groups = scan.get("GROUPS", 1)
            scan_t = scan.get("SCAN_T", False)
            for name, value in (("SPLIT", split), ("SEG_PREPARE", seg_prepare), ("SCAN_T", scan_t)):
                if not isinstance(value, bool):
                    raise ValueError(f"scan config {name}={value!r}: accepted True or False")
            for name, value in (("SEGMENTS", segments), ("GROUPS", groups)):
                if type(value) is not int or value < 1:
                    raise ValueError(f"scan config {name}={value!r}: accepted an integer >= 1")
            if scan_t and not scan_t_fits(K, V, split):
                raise ValueError(f"scan config SCAN_T=True with K={K}, V={V}, SPLIT={split}: T diag(beta) needs K + V "
                                 f">= {C} (W and U's place) in the one-pass scan, K >= {C} (W's) in the split scan")
            cut, cut_bv = cut_path.check_cut(scan, K, V)
            plan = plan._replace(scan=plan.scan._replace(BV=scan["BV"], SCAN_T=scan_t),
                                 prepare=plan.prepare._replace(T_OUT=scan_t), split=split, segments=segments,
                                 seg_prepare=seg_prepare, groups=groups, cut=cut, cut_bv=cut_bv,
                                 scan_options={k: v for k, v in scan.items() if k in LAUNCH_OPTIONS})
        return plan


def _check_keys(which: str, cfg: dict, accepted: tuple[str, ...]) -> None:
    unknown = sorted(set(cfg) - set(accepted))
    if unknown:
        raise ValueError(f"{which} config keys {unknown}: accepted {', '.join(accepted)}")


@_config.derived
@functools.lru_cache(maxsize=1024)
def plan_for(device: torch.device, dtype: torch.dtype, N: int, HV: int, K: int, V: int, per_seq: int) -> Plan:
    """The :class:`Plan` of a call (cached; ``per_seq``: tokens per sequence rounded down to a power of two)."""
    ws_dtype, dot_prec = workspace_dtype(dtype, device, K, V)
    BK, BV_full = pow2(K, 16), pow2(V, 16)
    BKC, BVC = min(BK, 64), min(BV_full, 64)
    wide_bv = min(BV_full, 64)  # V blocks of the single-launch and output kernels (narrower would be miscompiled)
    flags, prepare_options = prepare_config(device, dtype)
    scan = scan_config(device, N, HV, K, V, per_seq, dtype)
    split = scan.get("SPLIT", False)
    scan_t = scan.get("SCAN_T", default_scan_t(split)) and scan_t_fits(K, V, split)
    return Plan(
        ws_dtype=ws_dtype, ws_row=(K + V + CHUNK + 7) // 8 * 8 + 3 * (4 // ws_dtype.itemsize),
        prepare=PrepareConsts(K=K, V=V, BKC=BKC, BVC=BVC, C=CHUNK, DOT_PREC=dot_prec, T_OUT=scan_t, **flags),
        prepare_options=prepare_options,
        scan=ScanConsts(K=K, V=V, BK=BK, BV=scan["BV"], C=CHUNK, DOT_PREC=dot_prec, SCAN_T=scan_t),
        scan_options={k: v for k, v in scan.items() if k in LAUNCH_OPTIONS},
        output=OutputConsts(K=K, V=V, BK=BK, BV=wide_bv, C=CHUNK, DOT_PREC=dot_prec),
        single=SingleConsts(K=K, V=V, BKC=BKC, BVC=min(BVC, wide_bv), BK=BK, BV=wide_bv, C=CHUNK, DOT_PREC=dot_prec,
                            **flags),
        single_options={k: v for k, v in prepare_options.items() if k != "maxnreg"},
        split=split, segments=scan.get("SEGMENTS", 1), seg_prepare=scan.get("SEG_PREPARE", False),
        groups=scan.get("GROUPS", 1))
