"""CLI: `qwen35-accept --base-url URL [--api-key K] [--model M] [--only PATTERN] [--json OUT]`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from serve.accept.runner import FAIL, format_table, run_suite, select_checks
from serve.accept.suite import BEHAVIOUR, PROTOCOL


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen35-accept",
        description="OpenAI-API conformance checks for a chat endpoint. Exit code 1 when a protocol check fails.",
    )
    parser.add_argument(
        "--base-url",
        default=os.environ.get("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1"),
        help="API base as the OpenAI client takes it (default: $OPENAI_BASE_URL or %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="API key (default: $OPENAI_API_KEY); the 401 checks run only when one is given",
    )
    parser.add_argument("--model", help="model to test (default: the first one /v1/models lists)")
    parser.add_argument("--only", help="comma-separated check names, globs or substrings (e.g. 'stop_*,n2')")
    parser.add_argument("--kind", choices=[PROTOCOL, BEHAVIOUR], help="run only checks of this kind")
    parser.add_argument("--json", type=Path, help="write the JSON report here")
    parser.add_argument(
        "--max-model-len", type=int, help="context size, when the server does not report max_model_len on /v1/models"
    )
    parser.add_argument(
        "--no-thinking-switch",
        action="store_true",
        help="never send chat_template_kwargs.enable_thinking (reasoning checks then skip)",
    )
    parser.add_argument(
        "--vision",
        choices=["auto", "yes", "no"],
        default="auto",
        help="whether the model takes images (auto: the server's answer to one image decides)",
    )
    parser.add_argument(
        "--max-images",
        type=int,
        default=16,
        help="the server's limit of images per request; one more must be refused (default %(default)s)",
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default %(default)s)")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--quiet", action="store_true", help="no per-check progress lines on stderr")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        checks = select_checks(args.only, args.kind)
    except ValueError as error:
        print(f"qwen35-accept: {error}", file=sys.stderr)
        return 2
    if args.list:
        for item in checks:
            print(f"{item.kind:9}  {item.name:40}  {item.summary}")
        print(f"{len(checks)} checks")
        return 0

    def progress(result) -> None:
        if not args.quiet:
            mark = "!" if result.status == FAIL and result.kind == PROTOCOL else " "
            print(f"{mark}{result.status} {result.name} {result.reason[:100]}", file=sys.stderr, flush=True)

    try:
        report = run_suite(
            args.base_url,
            api_key=args.api_key,
            model=args.model,
            only=args.only,
            kind=args.kind,
            max_model_len=args.max_model_len,
            thinking_switch=not args.no_thinking_switch,
            vision=args.vision,
            max_images=args.max_images,
            timeout=args.timeout,
            on_result=progress,
        )
    except (RuntimeError, ValueError) as error:
        print(f"qwen35-accept: {error}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"report written to {args.json}")
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
