"""Run the registered checks against one endpoint and report: a table, a JSON document, an exit code."""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import httpx

# Importing the check modules registers their checks; they run section by section in this order.
from serve.accept import checks_behaviour, checks_chat, checks_images, checks_server, checks_structured
from serve.accept.client import Endpoint
from serve.accept.suite import BEHAVIOUR, CHECKS, PROTOCOL, Check, CheckFailed, CheckSkipped, Suite

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
SECTIONS = [m.__name__ for m in (checks_server, checks_chat, checks_structured, checks_images, checks_behaviour)]
VISION = ("auto", "yes", "no")


@dataclass
class CheckResult:
    name: str
    kind: str
    status: str
    reason: str
    seconds: float


@dataclass
class Report:
    base_url: str
    model: str
    max_model_len: int | None
    started: str
    seconds: float = 0.0
    results: list[CheckResult] = field(default_factory=list)

    def counts(self) -> dict[str, dict[str, int]]:
        table = {kind: {PASS: 0, FAIL: 0, SKIP: 0} for kind in (PROTOCOL, BEHAVIOUR)}
        for result in self.results:
            table[result.kind][result.status] += 1
        return table

    def protocol_failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.kind == PROTOCOL and r.status == FAIL]

    @property
    def exit_code(self) -> int:
        """Non-zero exactly when a protocol check failed."""
        return 1 if self.protocol_failures() else 0

    def to_json(self) -> dict:
        return {
            "base_url": self.base_url,
            "model": self.model,
            "max_model_len": self.max_model_len,
            "started": self.started,
            "seconds": round(self.seconds, 3),
            "summary": self.counts(),
            "exit_code": self.exit_code,
            "checks": [asdict(r) | {"seconds": round(r.seconds, 3)} for r in self.results],
        }


def select_checks(only: str | None = None, kind: str | None = None) -> list[Check]:
    """Registered checks in run order, filtered by comma-separated name patterns (globs, or
    substrings when a pattern has no wildcard) and by kind."""
    # Stable sort: registration order within a section.
    checks = sorted(CHECKS.values(), key=lambda c: (c.order, SECTIONS.index(c.run.__module__)))
    if kind is not None:
        if kind not in (PROTOCOL, BEHAVIOUR):
            raise ValueError(f"kind {kind!r} must be {PROTOCOL!r} or {BEHAVIOUR!r}")
        checks = [c for c in checks if c.kind == kind]
    if only:
        patterns = [p.strip() for p in only.split(",") if p.strip()]

        def matches(name: str) -> bool:
            return any(fnmatch.fnmatchcase(name, p) if any(ch in p for ch in "*?[") else p in name for p in patterns)

        checks = [c for c in checks if matches(c.name)]
        if not checks:
            raise ValueError(f"--only {only!r} matches no check; see --list")
    return checks


def run_check(suite: Suite, item: Check) -> CheckResult:
    start = time.perf_counter()
    try:
        note = item.run(suite)
        status, reason = PASS, note or ""
    except CheckFailed as failure:
        status, reason = FAIL, str(failure)
    except CheckSkipped as skipped:
        status, reason = SKIP, str(skipped)
    except httpx.HTTPError as error:
        status, reason = FAIL, f"transport: {type(error).__name__}: {error}"
    except Exception as error:  # a check that crashes on a strange reply is a failed check, not a crashed run
        status, reason = FAIL, f"reply: unexpected shape ({type(error).__name__}: {error})"
    return CheckResult(item.name, item.kind, status, reason, time.perf_counter() - start)


def discover_model(endpoint: Endpoint, model: str | None, max_model_len: int | None) -> tuple[str, int | None]:
    """The model to test (the first listed unless given) and its context size when the server
    reports one (vLLM's `max_model_len` on /v1/models)."""
    reply = endpoint.get("models")
    listed = reply.body.get("data") if reply.status == 200 and isinstance(reply.body, dict) else None
    if not isinstance(listed, list) or not listed:
        if model is None:
            raise RuntimeError(f"cannot list models at {endpoint.url('models')} (HTTP {reply.status}); pass --model")
        return model, max_model_len
    chosen = model or listed[0].get("id")
    for item in listed:
        if item.get("id") == chosen and max_model_len is None and isinstance(item.get("max_model_len"), int):
            max_model_len = item["max_model_len"]
    return chosen, max_model_len


def run_suite(
    base_url: str,
    api_key: str | None = None,
    model: str | None = None,
    only: str | None = None,
    kind: str | None = None,
    max_model_len: int | None = None,
    thinking_switch: bool = True,
    timeout: float = 120.0,
    on_result: Callable[[CheckResult], None] | None = None,
    vision: str = "auto",
    max_images: int = 16,
) -> Report:
    if vision not in VISION:
        raise ValueError(f"vision={vision!r}: expected one of {', '.join(VISION)}")
    if max_images < 0:
        raise ValueError(f"max_images={max_images}: expected a count >= 0")
    checks = select_checks(only, kind)
    endpoint = Endpoint(base_url, api_key=api_key, timeout=timeout)
    try:
        model, max_model_len = discover_model(endpoint, model, max_model_len)
        suite = Suite(endpoint, model, max_model_len=max_model_len, thinking_switch=thinking_switch, vision=vision,
                      max_images=max_images)  # fmt: skip
        report = Report(endpoint.base, model, max_model_len, datetime.now(timezone.utc).isoformat(timespec="seconds"))
        start = time.perf_counter()
        for item in checks:
            result = run_check(suite, item)
            report.results.append(result)
            if on_result is not None:
                on_result(result)
        report.seconds = time.perf_counter() - start
    finally:
        endpoint.close()
    return report


def format_table(report: Report, width: int = 110) -> str:
    """One line per check, then the totals per kind."""
    name_width = max([len(r.name) for r in report.results] + [5])
    lines = [f"{'STATUS':6}  {'KIND':9}  {'CHECK':{name_width}}  {'SEC':>5}  REASON"]
    for r in report.results:
        reason = " ".join(r.reason.split())
        reason = reason if len(reason) <= width else reason[: width - 3] + "..."
        lines.append(f"{r.status:6}  {r.kind:9}  {r.name:{name_width}}  {r.seconds:5.2f}  {reason}")
    lines.append("")
    for kind, counts in report.counts().items():
        lines.append(f"{kind:9}  pass {counts[PASS]:3}  fail {counts[FAIL]:3}  skip {counts[SKIP]:3}")
    lines.append(
        f"{report.model} at {report.base_url}: {len(report.results)} checks in {report.seconds:.1f} s; "
        f"exit code {report.exit_code}"
    )
    return "\n".join(lines)
