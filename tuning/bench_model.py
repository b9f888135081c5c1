"""Whole-model benchmark: the standalone host at Qwen3.5-35B-A3B width against HF transformers.

    python -m tuning.bench_model --out DIR [--quick] [--layers 8]
    python -m tuning.bench_model --out DIR --profile [--timed] [--sdpa] [--tag NAME]

Model: hidden 2048, 256 experts top-8 (I=512) + shared expert 512, GDN 16/32 heads K=V=128,
attention 16/2 heads of dim 256, vocab 248320, ``--layers`` decoder layers (every 4th full
attention), random bf16 weights made by HF transformers' ``Qwen3_5MoeForCausalLM`` and loaded
into ours through the checkpoint mapping (same tensors on both sides).

Rows (bf16, one H200):
- ``agreement``: our logits vs HF's on one prompt (every position), relative error;
- ``prefill``: tokens/s for N sequences x T tokens from empty caches, logits of the last position
  only, one step from an idle GPU and ``sustained`` (5 steps back to back, as a stream of prefills);
  anchor = HF transformers 5.17 figures from issue 5 (grouped_mm experts, FLA, same width);
- ``decode``: tokens/s of one step for B sequences holding ``ctx`` tokens (caches filled with random
  values: the time does not depend on them), eager and, when every op's backend allows capture,
  replayed as a CUDA graph; ``floor_ms`` = bytes the step must move (weights it reads, including
  the experts the batch is expected to touch, the LM head, KV cache and GDN state read + write)
  over the measured copy bandwidth, ``pct_of_floor`` = floor / ours.
Benchmarks report; they never assert times. The probe's backend table is printed and stored.

``--profile`` builds only our model (random weights, no HF) and profiles it (:mod:`tuning.profile_model`: device
and host time per range, the lag of the GPU behind the host, SDPA's choices) to ``model_profile[_TAG].json``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

import torch

from tuning import _bench

WIDTH = dict(vocab_size=248320, hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
             linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
             moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
             max_position_embeddings=32768, hidden_act="silu", tie_word_embeddings=False)
ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
# issue 5: HF transformers 5.17, 8 layers, same width, H200 (tokens/s)
HF_PREFILL = {(1, 8192): 112e3, (8, 4096): 120e3}
HF_DECODE = {1: 7.4, 16: 146.0}
TARGET_PREFILL, TARGET_DECODE = 350e3, {1: 500.0, 16: 3000.0}
FULL = dict(prefill=[(1, 8192), (8, 4096)], decode=[1, 16, 64], ctx=4096, agree_len=512)
QUICK = dict(prefill=[(1, 2048), (2, 1024)], decode=[1, 16], ctx=1024, agree_len=128)


def hf_config_fields(layers: int) -> dict:
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return dict(WIDTH, num_hidden_layers=layers, layer_types=layer_types, rope_parameters=dict(ROPE))


def build_models(layers: int, max_seqs: int, max_len: int, dtype: torch.dtype = torch.bfloat16):
    """(HF model, our standalone model) on cuda in ``dtype`` with the same random weights."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from qwen35.config import Qwen35Config
    from qwen35.standalone import Qwen35Standalone

    fields = hf_config_fields(layers)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("cuda"):
            hf = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**fields)).eval()
    finally:
        torch.set_default_dtype(default)
    cfg = Qwen35Config.from_dict({"architectures": ["Qwen3_5MoeForCausalLM"], **fields})
    ours = Qwen35Standalone(cfg, device="cuda", dtype=dtype, max_seqs=max_seqs, max_len=max_len)
    ours.load_state(hf.state_dict().items())
    return hf, ours


def _reps(fn, budget_s: float = 20.0) -> tuple[int, int]:
    """(warmup, rep) so that a row stays within ``budget_s`` whatever backend the probe picked."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = time.perf_counter() - t
    rep = max(1, min(20, int(budget_s / max(once, 1e-4) / 2)))
    return min(3, rep), rep


# ----------------------------------------------------------------------------- rows


def _sig(x: torch.Tensor | float) -> float:
    return float(f"{float(x):.3g}")


def _forced(op: str | None, backend: str | None) -> None:
    """Force ``op`` (or every op when ``op`` is None) onto ``backend``; ``backend=None`` clears all forcing."""
    from qwen35 import backends, probe

    for o in backends.OPS:
        os.environ.pop(f"QWEN35_BACKEND_{o.upper()}", None)
    os.environ.pop("QWEN35_BACKEND", None)
    if backend is not None:
        os.environ["QWEN35_BACKEND" if op is None else f"QWEN35_BACKEND_{op.upper()}"] = backend
    probe.reset()


def agreement_rows(hf, ours, length: int, label: str, per_op: bool) -> list[dict]:
    """Our logits (every position of one prompt) vs HF's: with the probe's backends, with every op on
    the reference, and (``per_op``) with one op at a time moved to the reference, which localises a
    disagreement to an op's kernel."""
    from qwen35 import probe

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, WIDTH["vocab_size"], (length,), generator=gen)
    with torch.no_grad():
        ref = hf(ids[None].cuda()).logits[0].float()

    def ours_logits() -> torch.Tensor:
        slot = ours.allocate(1)
        try:
            return ours.step(slot, [ids.tolist()], all_logits=True)
        finally:
            ours.release(slot)

    picked = {r["op"]: r["backend"] for r in probe.report("cuda")["ops"]}
    modes = [("probe", None, None), ("all reference", None, "reference")]
    if per_op:
        modes += [(f"{op} -> reference", op, "reference") for op, b in picked.items() if b != "reference"]
    rows, base = [], None
    try:
        for mode, op, backend in modes:
            _forced(op, backend)
            got = ours_logits()
            base = got if base is None else base
            rows.append(_bench.row(
                "agreement", f"1x{length}", label, 0.0, anchor="HF transformers (same weights)", mode=mode,
                rel_err=_sig((got - ref).norm() / ref.norm()),
                top1_match=round(float((got.argmax(-1) == ref.argmax(-1)).float().mean()), 4),
                rel_vs_probe=_sig((got - base).norm() / base.norm()), finite=bool(torch.isfinite(got).all())))
    finally:
        _forced(None, None)
    return rows


def fp32_agreement_rows(length: int) -> list[dict]:
    """The same width in fp32 with 4 layers (3 GDN + 1 attention): structure check free of bf16 noise."""
    hf, ours = build_models(4, max_seqs=1, max_len=length, dtype=torch.float32)
    try:
        return agreement_rows(hf, ours, length, "fp32", per_op=False)
    finally:
        del hf, ours
        torch.cuda.empty_cache()


def _prompts(n: int, t: int, seed: int, as_lists: bool = False) -> list:
    """n random prompts of t tokens, as int32 arrays (the host copies them without a Python loop) or lists."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randint(0, WIDTH["vocab_size"], (t,), generator=gen, dtype=torch.int32).numpy() for _ in range(n)]
    return [r.tolist() for r in rows] if as_lists else rows


SUSTAINED_STEPS = 5
IDLE_S = 0.05  # before each "one step, idle GPU" rep: the GPU idles as before a lone request (see _bench.time_ms)


def fresh_step(ours, prompts: list) -> None:
    """One step of ``prompts`` on newly allocated slots (fresh sequences), released afterwards."""
    slots = ours.allocate(len(prompts))
    try:
        ours.step(slots, prompts)
    finally:
        ours.release(slots)


def prefill_row(ours, n: int, t: int, as_lists: bool = False, sustained: bool = False) -> dict:
    """One prefill step of n fresh prompts of t tokens, from an idle GPU (host work before the first kernel is
    in the time; the GPU idles IDLE_S before each rep, so it starts below its power cap as for a lone request);
    ``sustained``: SUSTAINED_STEPS such steps issued back to back (each on fresh slots) and timed together, reps
    back to back, as a server runs a stream of prefills: the host builds step i+1 while the GPU runs step i,
    and the GPU runs at its power cap."""
    prompts = _prompts(n, t, 2, as_lists)

    def run():
        for _ in range(SUSTAINED_STEPS if sustained else 1):
            fresh_step(ours, prompts)

    warmup, rep = _reps(run)
    ms = _bench.time_ms(run, warmup=warmup, rep=rep, idle_s=0 if sustained else IDLE_S) / (
        SUSTAINED_STEPS if sustained else 1)
    tok_s = n * t / ms * 1e3
    hf = HF_PREFILL.get((n, t))
    return _bench.row("prefill", f"{n}x{t}", "bf16", ms, anchor="HF transformers 5.17 (issue 5)" if hf else None,
                      anchor_ms=n * t / hf * 1e3 if hf else None, tok_s=round(tok_s), target_tok_s=TARGET_PREFILL,
                      meets_target=tok_s >= TARGET_PREFILL, tokens="lists of ints" if as_lists else "int32 arrays",
                      mode=f"sustained ({SUSTAINED_STEPS} steps back to back)" if sustained else "one step, idle GPU")


def fill_context(ours, slots: list[int], ctx: int) -> None:
    """Pretend every slot already holds ``ctx`` tokens: random KV, conv history and GDN state."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    s0, n = slots[0], len(slots)
    for layer in ours.model.layers:
        mixer = layer.mixer
        if hasattr(mixer, "attn"):
            for cache in (mixer.attn.k_cache, mixer.attn.v_cache):
                cache[s0:s0 + n, :, :ctx].normal_(generator=gen)
        else:
            mixer.state.conv_pool[s0:s0 + n].normal_(generator=gen)
            mixer.state.state_pool[s0:s0 + n].normal_(std=0.02, generator=gen)
    for s in slots:
        ours.lengths[s] = ctx


def decode_floor_bytes(ours, B: int, ctx: int) -> float:
    """Bytes one decode step must move: weights read (experts expected to be touched) + caches."""
    cfg, elt = ours.cfg, 2
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    touched = E * (1 - (1 - k / E) ** B)  # expected distinct experts under uniform routing
    expert = 3 * cfg.moe_intermediate_size * cfg.hidden_size * elt
    total = 0.0
    for name, p in ours.model.named_parameters():
        if name.endswith(("mlp.w13", "mlp.w2")) or name == "embed_tokens.weight":
            continue
        total += p.numel() * p.element_size()
    moe_layers = cfg.num_hidden_layers
    total += moe_layers * touched * expert
    total += B * cfg.hidden_size * elt  # embedding rows
    n_attn = sum(t == "full_attention" for t in cfg.layer_types)
    n_gdn = cfg.num_hidden_layers - n_attn
    total += n_attn * B * ctx * 2 * cfg.num_key_value_heads * cfg.head_dim * elt  # K and V read
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    conv = cfg.gdn_conv_dim * (cfg.linear_conv_kernel_dim - 1) * elt
    total += n_gdn * B * 2 * (state + conv)  # read + write
    return total


def decode_rows(ours, B: int, ctx: int, copy_gbps: float) -> list[dict]:
    slots = ours.allocate(B)
    rows = []
    try:
        fill_context(ours, slots, ctx)
        tokens = torch.randint(0, WIDTH["vocab_size"], (B,)).tolist()
        floor_ms = decode_floor_bytes(ours, B, ctx) / (copy_gbps * 1e9) * 1e3
        steps = [[t] for t in tokens]

        def eager():
            ours.step(slots, steps)

        modes = [("eager", eager)]
        note = ""
        try:
            graph = ours.capture_decode(slots)
            modes.append(("cuda_graph", lambda: graph.step(tokens)))
        except Exception as e:  # noqa: BLE001 - reported in the row
            note = f"graph: {str(e)[:200]}"
        for mode, fn in modes:
            for s in slots:
                ours.lengths[s] = ctx
            warmup, rep = _reps(fn, budget_s=10.0)
            ms = _bench.time_ms(fn, warmup=warmup, rep=rep)
            tok_s = B / ms * 1e3
            hf = HF_DECODE.get(B)
            target = TARGET_DECODE.get(B)
            rows.append(_bench.row(
                "decode", f"B={B} ctx={ctx}", "bf16", ms, anchor="HF transformers 5.17 (issue 5)" if hf else None,
                anchor_ms=B / hf * 1e3 if hf else None, mode=mode, tok_s=round(tok_s, 1),
                floor_ms=round(floor_ms, 4), pct_of_floor=round(100 * floor_ms / ms, 1), target_tok_s=target,
                meets_target=None if target is None else tok_s >= target, note=note or None))
    finally:
        ours.release(slots)
    return rows


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_model", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="shorter prompts and contexts, B=1 and 16 only")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--profile", action="store_true",
                    help="our model only (random weights): torch.profiler breakdown of a 1x8192 prefill and eager "
                         "decode at B=1/16, written to model_profile[_TAG].json")
    ap.add_argument("--timed", action="store_true", help="with --profile: also time prefill and decode rows")
    ap.add_argument("--sdpa", action="store_true", help="with --profile: SDPA backend choice and cost per shape")
    ap.add_argument("--lag", action="store_true", help="with --profile: first a lag trace of each profiled prefill "
                    "(when the GPU reaches each layer vs when the host launched it; no profiler)")
    ap.add_argument("--tag", default="", help="with --profile: suffix of the JSON name")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_model: needs a CUDA device; nothing measured")
        return 0
    os.environ.setdefault("QWEN35_CHECK_VALUES", "0")  # no host syncs from the façade's value checks
    if args.profile:
        from tuning import profile_model

        return profile_model.profile_main(args)
    plan = QUICK if args.quick else FULL
    from qwen35 import probe

    report = probe.format_report(probe.report("cuda"))
    print(report, flush=True)
    try:
        import fla  # noqa: F401 - HF uses FLA's kernels when it imports

        hf_gdn = "fla"
    except Exception:  # noqa: BLE001
        hf_gdn = "torch fallback (fla not importable)"
    ceil = _bench.ceilings()
    max_b = max(plan["decode"] + [n for n, _ in plan["prefill"]])
    max_len = max(plan["ctx"] + 64, max(t for _, t in plan["prefill"]), plan["agree_len"])
    t0 = time.time()
    hf, ours = build_models(args.layers, max_seqs=max_b, max_len=max_len)
    print(f"built models in {time.time() - t0:.1f}s", flush=True)
    rows: list[dict] = []
    name_json = f"model_qwen35moe_{args.layers}l" + ("_quick" if args.quick else "")
    meta = dict(layers=args.layers, width=WIDTH, quick=args.quick, ceilings=ceil, hf_gdn=hf_gdn,
                check_values=os.environ.get("QWEN35_CHECK_VALUES"))
    parts = [("agreement", lambda: agreement_rows(hf, ours, plan["agree_len"], "bf16", per_op=True))]
    parts += [(f"prefill {n}x{t}", lambda n=n, t=t: [prefill_row(ours, n, t), prefill_row(ours, n, t, sustained=True)])
              for n, t in plan["prefill"]]
    parts += [(f"decode B={b}", lambda b=b: decode_rows(ours, b, plan["ctx"], ceil["copy_GBps"]))
              for b in plan["decode"]]
    parts.append(("agreement fp32", lambda: fp32_agreement_rows(plan["agree_len"])))
    for name, part in parts:
        before = len(rows)
        try:
            rows += part()
        except Exception:  # noqa: BLE001 - one failed row must not lose the others
            print(f"--- {name} failed:\n{traceback.format_exc()}", flush=True)
            rows.append(_bench.row(name.split()[0], name, "bf16", math.nan, error=traceback.format_exc()[-400:]))
        if name == "agreement":
            del hf  # frees its copy of the weights before the timed rows
            torch.cuda.empty_cache()
        for r in rows[before:]:
            print(f"[{time.time() - t0:.0f}s] {name} {r.get('mode') or ''}: ours_ms={r['ours_ms']} "
                  f"tok_s={r.get('tok_s')} pct_of_floor={r.get('pct_of_floor')} rel_err={r.get('rel_err')}", flush=True)
        meta["backends"] = probe.report("cuda")["ops"]
        path = _bench.write_results(args.out, name_json, rows, meta)  # after every part: a timeout keeps the rest
    print(report)
    print(_bench.format_table(rows, ["op", "shape", "dtype", "mode", "ours_ms", "tok_s", "anchor_ms", "speedup",
                                     "pct_of_floor", "meets_target", "rel_err", "top1_match", "rel_vs_probe"]))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
