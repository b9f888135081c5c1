"""CLI: `qwen35-bench replay ...` and `qwen35-bench generate ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import httpx

from serve.accept.client import split_base_url
from serve.bench.generate import (
    TOKENS_PER_WORD,
    MixConfig,
    fit_requests,
    generate_requests,
    read_requests,
    write_requests,
)
from serve.bench.replay import Progress, ReplayConfig, format_summary, replay, summarize


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _models(base_url: str, api_key: str | None) -> list[dict]:
    """The entries of the server's /v1/models; RuntimeError saying what to pass instead."""
    base, _ = split_base_url(base_url)
    try:
        reply = httpx.get(base + "/models", headers=_headers(api_key), timeout=30)
    except httpx.HTTPError as error:
        raise RuntimeError(f"cannot reach {base}/models ({type(error).__name__}: {error})") from None
    data = reply.json().get("data") if reply.status_code == 200 else None
    if not data:
        raise RuntimeError(f"cannot list models at {base}/models (HTTP {reply.status_code})")
    return data


def _first_model(base_url: str, api_key: str | None) -> str:
    try:
        return _models(base_url, api_key)[0]["id"]
    except RuntimeError as error:
        raise RuntimeError(f"{error}; pass --model") from None


def _context_of(base_url: str, api_key: str | None, model: str | None) -> tuple[str, int]:
    """(model, max_model_len) as the server's /v1/models reports them."""
    entries = _models(base_url, api_key)
    entry = next((e for e in entries if e.get("id") == model), None) if model else entries[0]
    if entry is None:
        raise RuntimeError(f"{base_url}/models does not list {model!r} (it lists {[e.get('id') for e in entries]})")
    length = entry.get("max_model_len")
    if not isinstance(length, int) or length < 1:
        raise RuntimeError(f"{base_url}/models reports no max_model_len for {entry.get('id')!r}; pass --max-model-len")
    return entry["id"], length


def _token_counter(base_url: str, api_key: str | None, model: str) -> Callable[[dict], int]:
    """Prompt tokens of a chat body, counted by the server's `/tokenize` (vLLM's)."""
    _, root = split_base_url(base_url)
    client = httpx.Client(headers=_headers(api_key), timeout=60)

    def count(body: dict) -> int:
        payload = {"model": model, "messages": body["messages"], "add_generation_prompt": True}
        if body.get("tools"):
            payload["tools"] = body["tools"]
        reply = client.post(root + "/tokenize", json=payload)
        if reply.status_code != 200:
            raise RuntimeError(f"{root}/tokenize answered HTTP {reply.status_code}: {reply.text[:200]}")
        return int(reply.json()["count"])

    return count


def cmd_replay(args: argparse.Namespace) -> int:
    requests = read_requests(args.requests)
    if args.limit:
        requests = requests[: args.limit]
    model = args.model or _first_model(args.base_url, args.api_key)
    config = ReplayConfig(
        base_url=args.base_url, model=model, api_key=args.api_key,
        concurrency=None if args.rate else args.concurrency, rate=args.rate, duration=args.duration,
        timeout=args.timeout, seed=args.seed, ignore_eos=args.ignore_eos, token_ids=args.token_ids,
    )  # fmt: skip
    progress = Progress(
        None if args.duration else len(requests), args.duration, enabled=None if args.progress else False
    )
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    records, wall = replay(requests, config, on_done=progress)
    progress.close()
    summary = summarize(records, wall)
    print(format_summary(summary, config))
    if args.json:
        report = {
            "started": started,
            "config": {**config.__dict__, "api_key": bool(config.api_key), "requests_file": str(args.requests)},
            "summary": summary,
            "requests": [r.to_json() for r in records],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0 if summary["succeeded"] else 1


def cmd_generate(args: argparse.Namespace) -> int:
    config = MixConfig(
        num_requests=args.num, seed=args.seed, system_prompts=args.system_prompts, system_words=args.system_words,
        prompt_words_median=args.prompt_words, prompt_words_max=args.prompt_words_max,
        output_tokens_median=args.output_tokens, output_tokens_max=args.output_tokens_max, sigma=args.sigma,
        multi_turn_share=args.multi_turn_share, max_prior_turns=args.max_prior_turns, turn_words_median=args.turn_words,
        tool_share=args.tool_share, max_tools=args.max_tools, temperature=args.temperature,
    )  # fmt: skip
    requests = generate_requests(config)
    fitted = ""
    if args.max_model_len != 0:
        count = None
        if args.max_model_len is None:
            try:
                model, length = _context_of(args.base_url, args.api_key, args.model)
            except RuntimeError as error:
                raise RuntimeError(f"{error}: start the server, or pass --max-model-len N (0: do not fit)") from None
            count, where = _token_counter(args.base_url, args.api_key, model), f"{model} at {args.base_url}"
        else:
            length, where = args.max_model_len, "--max-model-len"
        requests, report = fit_requests(requests, length, count, args.tokens_per_word)
        how = (
            "counted by the server's tokenizer"
            if report.exact
            else f"estimated at {args.tokens_per_word:g} tokens a word"
        )
        fitted = (
            f"; fitted to max_model_len {length} of {where} ({how}): {report.shortened} prompts shortened, "
            f"{report.capped} max_tokens capped"
        )
    write_requests(args.out, requests)
    tools = sum("tools" in r for r in requests)
    turns = sum(sum(m["role"] == "user" for m in r["messages"]) > 1 for r in requests)
    print(f"wrote {len(requests)} requests to {args.out} ({tools} with tools, {turns} multi-turn){fitted}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qwen35-bench", description="Throughput benchmark for OpenAI endpoints.")
    commands = parser.add_subparsers(dest="command", required=True)

    rep = commands.add_parser("replay", help="replay a JSONL request set, streaming, and report TPS / score / latency")
    rep.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"))
    rep.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    rep.add_argument("--model", help="default: the first model /v1/models lists")
    rep.add_argument("--requests", type=Path, required=True, help="JSONL, one chat request body per line")
    load = rep.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight (default 8)")
    load.add_argument("--rate", type=float, help="open loop: mean requests per second (Poisson arrivals)")
    rep.add_argument("--duration", type=float, help="cycle the set for this many seconds (default: each once)")
    rep.add_argument("--limit", type=int, help="use only the first N requests of the file")
    rep.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos: replies run to max_tokens")
    rep.add_argument(
        "--token-ids",
        action="store_true",
        help="ask vLLM for return_token_ids: ITL then counts every token, shown or held back",
    )
    rep.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default %(default)s)")
    rep.add_argument("--seed", type=int, default=0, help="seed of the open-loop arrival times")
    rep.add_argument("--json", type=Path, help="write the JSON report here")
    rep.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="progress bar on stderr when it is a terminal (default on)",
    )
    rep.set_defaults(run=cmd_replay)

    gen = commands.add_parser("generate", help="write a synthetic request set (JSONL)")
    gen.add_argument("--out", type=Path, required=True)
    gen.add_argument(
        "--base-url",
        default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
        help="the target server: prompts are fitted to its max_model_len and counted by its tokenizer",
    )
    gen.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    gen.add_argument("--model", help="the target's model (default: the first /v1/models lists)")
    gen.add_argument(
        "--max-model-len",
        type=int,
        help="fit to this context instead of asking the server (sizes estimated); 0: do not fit",
    )
    gen.add_argument(
        "--tokens-per-word",
        type=float,
        default=TOKENS_PER_WORD,
        help="estimate used with --max-model-len (default %(default)s)",
    )
    defaults = MixConfig()
    gen.add_argument("--num", type=int, default=defaults.num_requests)
    gen.add_argument("--seed", type=int, default=defaults.seed)
    gen.add_argument("--system-prompts", type=int, default=defaults.system_prompts, help="distinct shared prefixes")
    gen.add_argument("--system-words", type=int, default=defaults.system_words)
    gen.add_argument("--prompt-words", type=int, default=defaults.prompt_words_median, help="median user words")
    gen.add_argument("--prompt-words-max", type=int, default=defaults.prompt_words_max)
    gen.add_argument("--output-tokens", type=int, default=defaults.output_tokens_median, help="median max_tokens")
    gen.add_argument("--output-tokens-max", type=int, default=defaults.output_tokens_max)
    gen.add_argument("--sigma", type=float, default=defaults.sigma, help="log-normal tail (default %(default)s)")
    gen.add_argument("--multi-turn-share", type=float, default=defaults.multi_turn_share)
    gen.add_argument("--max-prior-turns", type=int, default=defaults.max_prior_turns)
    gen.add_argument("--turn-words", type=int, default=defaults.turn_words_median, help="median words per earlier turn")
    gen.add_argument("--tool-share", type=float, default=defaults.tool_share)
    gen.add_argument("--max-tools", type=int, default=defaults.max_tools, help="tool definitions per request, at most")
    gen.add_argument("--temperature", type=float, default=defaults.temperature)
    gen.set_defaults(run=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"qwen35-bench: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
