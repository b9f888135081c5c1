"""The run loop of ``qwen35-tune``: check, time and choose launch configs per (op, shape, token bucket); write them.

A :class:`Task` is one token bucket of one shape of one tunable op. It has a search space (axes of values, a rule
that excludes combinations the device cannot run or that the code records as miscompiled, seeds to start from) and
one or more :class:`Workload` s: input layouts on the device, each with the op's own choice (its heuristic, the
baseline) and, for a candidate config, the :class:`Part` s to run (launch groups timed apart and summed, e.g. the
two MoE GEMMs; memoised, so a candidate that changes one GEMM times only that one).

Per task:

1. every part runs once on fresh check inputs (not the timing inputs, outputs pre-filled with NaN) and is compared
   with the op's reference in fp64 (:mod:`qwen35.reference`): relative error (norm) and largest error (over the
   largest reference value) of each output. The baseline must pass the op's self-test tolerance
   (:data:`qwen35.optable.SELFTEST_TOLERANCE`); a candidate must pass it and stay within ``ERR_FACTOR`` times the
   baseline's errors (at least a tenth of the tolerance). A non-finite, wrong or crashing candidate is recorded as
   rejected with the reason and never timed or chosen;
2. what passes is timed: CUDA-graph replay of calls cycling over input sets whose memory exceeds L2 (small cases),
   else CUDA events around each call with L2 flushed before it; the median of the repeats. On the CPU (Triton's
   interpreter, for tests) by wall clock;
3. search: the seeds, then hill climbing (every one-step move along an axis from the best so far) while the best
   improves and the task's share of the budget lasts; an explicit candidate list is tried in full instead;
4. the best and the baseline are timed again, interleaved; the best is written only when it beats the baseline by
   ``MIN_GAIN`` in every workload's mean (and is not slower in any); otherwise the bucket records that the heuristic
   stays (``{"heuristic": true, ...}``; the loader returns None there).

Each finished bucket is written at once (atomically: a temporary file renamed over the old one), so Ctrl-C keeps it
and a rerun skips it.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tuning.tune_files import ConfigFiles, atomic_write_json, device_name, rounded

MIN_GAIN = 0.01  # a tuned config must be at least this much faster than the heuristic to be written
ERR_FACTOR = 4.0  # a candidate's errors may be this many times the heuristic config's
CONFIRM_ROUNDS = 3
GPU_REPS = 10
CPU_REPS = 1
GRAPH_CALLS = 20  # calls per captured graph (at least one per input set)


# ----------------------------------------------------------------------------- what a tunable op provides


@dataclass
class Part:
    """One launch group of a candidate on one workload. ``check()`` runs it on the check inputs and returns
    ``[(output name, got, reference)]``; ``calls()`` the timing calls (one per input set, cycled); ``graph``: time by
    CUDA-graph replay (small cases) rather than events."""

    key: Hashable
    check: Callable[[], list[tuple[str, torch.Tensor, torch.Tensor]]]
    calls: Callable[[], list[Callable[[], object]]]
    graph: bool


@dataclass
class Workload:
    """One input layout of a task: ``baseline`` is the config the op chooses by its heuristic (in the form ``parts``
    takes), ``current`` the one the loaded config files give (None when the same), ``parts(config)`` the launch
    groups of a config."""

    label: str
    baseline: dict
    parts: Callable[[dict], list[Part]]
    current: dict | None = None


@dataclass
class Task:
    """One (tunable, shape, token bucket): what to search and how to build its workloads on a device."""

    tunable: str
    files: dict[str, str]  # config file op -> shape key
    bucket: int
    label: str  # the shape, for tables
    axes: dict[str, tuple]
    excluded: Callable[[dict], str | None]  # why a candidate is outside the space, or None
    size: int  # candidates in the space (for plans)
    tolerance: float
    space_hash: dict[str, str]  # config file op -> hash of the search space declaration
    workloads: Callable[[torch.device], list[Workload]]
    seeds: Callable[[list[Workload], bool], list[dict]]  # (workloads, from_scratch) -> candidates to start from
    entries: Callable[[dict], dict[str, dict]]  # candidate -> {config file op: the fields its entry holds}
    explicit: list[dict] | None = None  # try exactly these (in order, not pruned) instead of searching
    note: str = ""
    spec: tuple | None = None  # what rebuilds the task in another process (compile warm-up), None: nothing

    @property
    def name(self) -> str:
        return f"{self.tunable} {self.label} @{self.bucket}"


# ----------------------------------------------------------------------------- checks


def output_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(relative error by norm, largest error over the largest reference value); inf for a non-finite output."""
    if got.shape != want.shape:
        raise ValueError(f"output shape {tuple(got.shape)} != reference {tuple(want.shape)}")
    if not got.numel():
        return 0.0, 0.0
    g, w = got.detach().double(), want.detach().to(got.device, torch.float64)  # on the device: scalars come back
    if not bool(torch.isfinite(g).all()):
        return math.inf, math.inf
    diff = g - w
    rel = float(diff.norm() / w.norm().clamp_min(1e-30))
    peak = float(diff.abs().max() / w.abs().max().clamp_min(1e-30))
    return rel, peak


def judge(errors: dict[str, tuple[float, float]], baseline: dict[str, tuple[float, float]] | None,
          tolerance: float) -> str | None:
    """Why outputs with ``errors`` are wrong, or None: non-finite, past ``tolerance``, or (against the baseline's
    errors) past ``ERR_FACTOR`` times them (at least a tenth of the tolerance)."""
    for name, (rel, peak) in errors.items():
        if not (math.isfinite(rel) and math.isfinite(peak)):
            return f"non-finite {name}"
        for what, value, index in (("rel err", rel, 0), ("largest err", peak, 1)):
            limit = tolerance
            if baseline is not None and name in baseline:
                limit = min(tolerance, max(ERR_FACTOR * baseline[name][index], tolerance / 10))
            if value > limit:
                return f"wrong {name}: {what} {value:.3g} > {limit:.3g}"
    return None


# ----------------------------------------------------------------------------- timing


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


class Timer:
    """Times a part's calls on ``device`` (see the module docstring); ``flush`` is the L2-sized buffer cleared
    before each event-timed call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.flush: torch.Tensor | None = None
        if device.type == "cuda":
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (64 << 20)
            self.flush = torch.empty(2 * l2, dtype=torch.uint8, device=device)

    def __call__(self, part: Part) -> float:
        calls = part.calls()
        if self.device.type != "cuda":
            times = []
            for i in range(CPU_REPS):
                t0 = time.perf_counter()
                calls[i % len(calls)]()
                times.append((time.perf_counter() - t0) * 1e3)
            return _median(times)
        if part.graph:
            try:
                return self._graph_ms(calls)
            except Exception:  # noqa: BLE001 - not capturable: events instead
                torch.cuda.synchronize(self.device)
        return self._events_ms(calls)

    def _graph_ms(self, calls: list[Callable[[], object]]) -> float:
        n = max(GRAPH_CALLS, len(calls))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for fn in calls:
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n):
                calls[i % len(calls)]()
        graph.replay()
        torch.cuda.synchronize(self.device)
        times = []
        for _ in range(GPU_REPS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / n)
        return _median(times)

    def _events_ms(self, calls: list[Callable[[], object]]) -> float:
        for fn in calls:
            fn()
        torch.cuda.synchronize(self.device)
        times = []
        for i in range(GPU_REPS):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[i % len(calls)]()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return _median(times)


class ContextLost(RuntimeError):
    """A candidate left the CUDA context unusable: the process cannot go on (the candidate is recorded)."""


def device_alive(device: torch.device) -> bool:
    """Whether the device still runs work (a candidate that faults leaves the CUDA context unusable)."""
    if device.type != "cuda":
        return True
    try:
        torch.cuda.synchronize(device)
        return torch.ones(1, device=device).add_(1).item() == 2.0
    except Exception:  # noqa: BLE001 - a sticky CUDA error: the context is gone
        return False


def reason(e: BaseException) -> str:
    """A rejection reason for an exception: its type and message, on one line."""
    return f"crashed: {type(e).__name__}: {' '.join(str(e).split())[:200]}"


# ----------------------------------------------------------------------------- one task


def _ckey(cand: dict) -> tuple:
    return tuple(sorted(cand.items()))


@dataclass
class Outcome:
    """What a task found: ``best`` (None: the heuristic stays) and the numbers of the bucket's record."""

    task: Task
    status: str  # "tuned", "heuristic", "failed", "skipped", "not started"
    best: dict | None = None
    tuned_ms: float | None = None
    heuristic_ms: float | None = None
    before_ms: float | None = None
    tried: int = 0
    rejected: list[dict] = field(default_factory=list)
    layouts: list[dict] = field(default_factory=list)
    budget_cut: bool = False
    note: str = ""


class TaskRun:
    """The search of one task on its workloads (see the module docstring)."""

    def __init__(self, task: Task, device: torch.device, timer: Timer, crashed: set[tuple],
                 warm: Callable[[Task, list[dict]], dict[tuple, str]] | None = None) -> None:
        self.task, self.device, self.timer, self.crashed, self.warm = task, device, timer, crashed, warm
        self.prefailed: dict[tuple, str] = {}  # candidates the compile warm-up saw fail
        self.workloads = task.workloads(device)
        self.memo: list[dict] = [{} for _ in self.workloads]  # per workload: part key -> ms or reason (str)
        self.base_errors: list[dict] = [{} for _ in self.workloads]
        self.results: dict[tuple, list[float] | str] = {}  # candidate -> ms per workload, or why rejected
        self.order: list[dict] = []
        self.on_candidate: Callable[[], None] = lambda: None
        self.last_crash: dict | None = None

    def _part(self, w: int, part: Part, baseline: bool) -> float | str:
        memo = self.memo[w]
        if part.key in memo:
            return memo[part.key]
        try:
            outputs = part.check()
            errors = {name: output_errors(got, want) for name, got, want in outputs}
            if baseline:
                self.base_errors[w].update(errors)
            why = judge(errors, None if baseline else self.base_errors[w], self.task.tolerance)
            memo[part.key] = why if why else self.timer(part)
        except Exception as e:  # noqa: BLE001 - a crashing candidate is a rejected one
            memo[part.key] = reason(e)
            if not device_alive(self.device):
                raise ContextLost(memo[part.key]) from e
        return memo[part.key]

    def baseline(self) -> list[float]:
        """The heuristic's time per workload; RuntimeError when it fails its own check."""
        out = []
        for w, wl in enumerate(self.workloads):
            total = 0.0
            for part in wl.parts(wl.baseline):
                r = self._part(w, part, baseline=True)
                if isinstance(r, str):
                    raise RuntimeError(f"the heuristic config {wl.baseline} fails ({wl.label}): {r}")
                total += r
            out.append(total)
        return out

    def evaluate(self, cand: dict) -> list[float] | str:
        """``cand``'s time per workload, or why it was not timed (``excluded: ...`` when outside the space)."""
        key = _ckey(cand)
        if key in self.results:
            return self.results[key]
        why = self.task.excluded(cand) if self.task.explicit is None else None  # an explicit list is tried as is
        why = f"excluded: {why}" if why else None
        if why is None and key in self.crashed:
            why = "crashed: lost the CUDA context in an earlier run"
        if why is None and key in self.prefailed:
            why = self.prefailed[key]
        if why is None:
            per = []
            for w, wl in enumerate(self.workloads):
                total = 0.0
                for part in wl.parts(cand):
                    self.last_crash = cand
                    r = self._part(w, part, baseline=False)
                    self.last_crash = None
                    if isinstance(r, str):
                        why = r
                        break
                    total += r
                if why:
                    break
                per.append(total)
        self.results[key] = why if why else per
        if not (why or "").startswith("excluded"):
            self.order.append(cand)
            self.on_candidate()
        return self.results[key]

    def prewarm(self, cands: list[dict]) -> None:
        """Compile the candidates not tried yet in the warm-up processes, all at once (Triton's cache then has them
        when they are checked and timed here, one by one); those that fail there are rejected without running
        here."""
        if self.warm is None or self.task.spec is None:
            return
        todo, seen = [], set()
        for c in cands:
            key = _ckey(c)
            if key in self.results or key in self.prefailed or key in self.crashed or key in seen:
                continue
            if self.task.explicit is None and self.task.excluded(c) is not None:
                continue
            seen.add(key)
            todo.append(c)
        if todo:
            self.prefailed.update(self.warm(self.task, todo))

    def score(self, per: list[float], base: list[float]) -> float:
        return sum(p / b for p, b in zip(per, base, strict=True)) / len(per)

    def tried(self) -> int:
        return len(self.order)

    def rejected(self) -> list[dict]:
        return [{"config": self.task.entries(c), "reason": self.results[_ckey(c)]} for c in self.order
                if isinstance(self.results[_ckey(c)], str)]

    def search(self, base: list[float], from_scratch: bool, until: float) -> tuple[dict | None, bool]:
        """(the best candidate found, whether the deadline cut the search)."""
        best, best_score = None, math.inf

        def consider(c: dict) -> None:
            nonlocal best, best_score
            r = self.evaluate(c)
            if not isinstance(r, str):
                s = self.score(r, base)
                if s < best_score:
                    best, best_score = c, s

        if self.task.explicit is not None:
            self.prewarm(self.task.explicit)
            for c in self.task.explicit:
                if time.time() > until and best is not None:
                    return best, True
                consider(c)
            return best, False
        seeds = self.task.seeds(self.workloads, from_scratch)
        self.prewarm(seeds)
        for c in seeds:
            consider(c)
        while best is not None:
            before = best_score
            neighbours = self._neighbours(best)
            self.prewarm(neighbours)
            for c in neighbours:
                if time.time() > until:
                    return best, True
                consider(c)
            if best_score >= before * (1 - MIN_GAIN / 2):
                break
        return best, False

    def _neighbours(self, cand: dict) -> list[dict]:
        out = []
        for axis, values in self.task.axes.items():
            if axis not in cand or cand[axis] not in values:
                continue
            i = values.index(cand[axis])
            for j in (i - 1, i + 1):
                if 0 <= j < len(values):
                    c = {**cand, axis: values[j]}
                    if _ckey(c) not in self.results and self.task.excluded(c) is None:
                        out.append(c)
        return out

    def confirm(self, best: dict) -> tuple[list[float], list[float]]:
        """(best, baseline) times per workload, measured again in interleaved rounds (medians)."""
        bests, bases = [], []
        for wl in self.workloads:
            b_runs, h_runs = [], []
            for _ in range(CONFIRM_ROUNDS):
                b_runs.append(sum(self.timer(p) for p in wl.parts(best)))
                h_runs.append(sum(self.timer(p) for p in wl.parts(wl.baseline)))
            bests.append(_median(b_runs))
            bases.append(_median(h_runs))
        return bests, bases

    def before_ms(self) -> float | None:
        """The time of what the loaded files give now, on the first workload (None: the same as the heuristic, or it
        fails its check)."""
        wl = self.workloads[0]
        if wl.current is None:
            return None
        total = 0.0
        for part in wl.parts(wl.current):
            t = self._part(0, part, baseline=False)
            if isinstance(t, str):
                return None
            total += t
        return total


def tune_task(task: Task, device: torch.device, timer: Timer, from_scratch: bool, until: float,
              crashed: set[tuple], on_candidate: Callable[[TaskRun], None] = lambda run: None,
              warm: Callable[[Task, list[dict]], dict[tuple, str]] | None = None) -> Outcome:
    run = TaskRun(task, device, timer, crashed, warm)
    run.on_candidate = lambda: on_candidate(run)
    try:
        base = run.baseline()
        before = run.before_ms()
        best, cut = run.search(base, from_scratch, until)
    except ContextLost:
        if run.last_crash is not None:
            crashed.add(_ckey(run.last_crash))
        raise
    except RuntimeError as e:
        return Outcome(task, "failed", tried=run.tried(), rejected=run.rejected(), note=str(e)[:300])
    out = Outcome(task, "heuristic", heuristic_ms=base[0], before_ms=before, tried=run.tried(),
                  rejected=run.rejected(), budget_cut=cut)
    if best is None:
        out.note = "no candidate passed its check"
        return out
    bests, bases = run.confirm(best)
    ratios = [b / h for b, h in zip(bests, bases, strict=True)]
    out.heuristic_ms = bases[0]
    out.tuned_ms = bests[0]
    if len(bests) > 1:
        out.layouts = [{"layout": wl.label, "tuned_ms": round(b, 6), "heuristic_ms": round(h, 6)}
                       for wl, b, h in zip(run.workloads, bests, bases, strict=True)]
    out.best = best
    if max(ratios) <= 1.0 and sum(ratios) / len(ratios) <= 1 - MIN_GAIN:
        out.status = "tuned"
    else:
        out.note = f"best candidate {sum(ratios) / len(ratios):.3f}x the heuristic's time: the heuristic stays"
    return out


# ----------------------------------------------------------------------------- the run


class Progress:
    """One status line (rewritten in place on a terminal) with the bucket, candidates so far and the ETA; one line
    per finished bucket."""

    def __init__(self, total: int, deadline: float, stream=None) -> None:  # noqa: ANN001 - a text stream
        self.total, self.deadline, self.stream = total, deadline, stream or sys.stderr
        self.start, self.finished, self.index = time.time(), 0, 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def eta(self) -> float:
        now = time.time()
        left = max(self.deadline - now, 0.0)
        if not self.finished:
            return left
        per = (now - self.start) / self.finished
        return min(left, per * (self.total - self.finished))

    def _status(self, text: str) -> str:
        return (f"[{self.index + 1}/{self.total}] {text} | elapsed {_clock(time.time() - self.start)}, "
                f"ETA {_clock(self.eta())}")

    def tick(self, run: TaskRun) -> None:
        if self.tty:
            rejected = len(run.rejected())
            self.stream.write("\r\033[K" + self._status(f"{run.task.name}: {run.tried()} tried, {rejected} rejected"))
            self.stream.flush()

    def done(self, out: Outcome) -> None:
        self.finished += 1
        head = "\r\033[K" if self.tty else ""
        self.stream.write(head + self._status(f"{out.task.name}: {describe(out)}") + "\n")
        self.stream.flush()
        self.index += 1


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s"


def describe(out: Outcome) -> str:
    if out.status == "tuned":
        return (f"tuned {out.tuned_ms:.4g} ms against the heuristic's {out.heuristic_ms:.4g} "
                f"({out.heuristic_ms / out.tuned_ms:.3f}x), {out.tried} tried, {len(out.rejected)} rejected")
    if out.status == "heuristic":
        return f"the heuristic stays ({out.note}), {out.tried} tried, {len(out.rejected)} rejected"
    return f"{out.status}: {out.note}"


def _crash_path(files: ConfigFiles) -> Path:
    return files.dir / ".qwen35-tune-crashed.json"


def _load_crashed(files: ConfigFiles) -> dict[str, set[tuple]]:
    try:
        raw = json.loads(_crash_path(files).read_text())
        return {k: {_ckey(c) for c in v} for k, v in raw.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _save_crashed(files: ConfigFiles, crashed: dict[str, set[tuple]]) -> None:
    atomic_write_json(_crash_path(files), {k: [dict(c) for c in sorted(v)] for k, v in crashed.items() if v})


def run_tasks(tasks: list[Task], device: torch.device, out: Path, budget_s: float, from_scratch: bool,
              prov: dict, outcomes: list[Outcome], stream=None,  # noqa: ANN001 - a text stream
              warm: Callable[[Task, list[dict]], dict[tuple, str]] | None = None) -> list[Outcome]:
    """Tune every task not already in the files under ``out`` within ``budget_s`` seconds, writing each finished
    bucket at once; appends to ``outcomes`` as it goes (the caller keeps them through a Ctrl-C). ``warm``: compiles
    a list of candidates of a task in other processes first (:class:`tuning.tune_ops.WarmPool`)."""
    files = ConfigFiles(out, device_name(device), prov)
    crashed = _load_crashed(files)
    timer = Timer(device)
    deadline = time.time() + budget_s
    todo = []
    for task in tasks:
        if files.done(task):
            outcomes.append(Outcome(task, "skipped", note="already in " + str(files.path(next(iter(task.files))))))
        else:
            todo.append(task)
    for note in files.notes:
        print(f"note: {note}", file=stream or sys.stderr)
    progress = Progress(len(todo), deadline, stream)
    for i, task in enumerate(todo):
        now = time.time()
        if now >= deadline:
            outcomes.append(Outcome(task, "not started", note="the budget is spent: a rerun continues here"))
            continue
        until = now + (deadline - now) / (len(todo) - i)
        mine = crashed.setdefault(f"{task.tunable} {task.label}", set())
        try:
            result = tune_task(task, device, timer, from_scratch, until, mine, progress.tick, warm)
        except ContextLost:
            _save_crashed(files, crashed)
            raise
        except Exception as e:  # noqa: BLE001 - one bucket's failure does not stop the others
            result = Outcome(task, "failed", note=reason(e))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        if result.status in ("tuned", "heuristic"):
            files.record(result)
        outcomes.append(result)
        progress.done(result)
    return outcomes


def summary_rows(outcomes: list[Outcome]) -> list[dict]:
    """The final table's rows: op, shape, bucket, heuristic ms, tuned ms (none where the heuristic stays), speedup
    over the heuristic, the time of what the files gave before (``before_ms``, where it is not the heuristic) and
    the chosen config's speed relative to it (``vs_before``), rejected candidates, result."""
    rows = []
    for o in outcomes:
        tuned = o.tuned_ms if o.status == "tuned" else None
        chosen = tuned if tuned else o.heuristic_ms if o.status == "heuristic" else None
        rows.append({"op": o.task.tunable, "shape": o.task.label, "bucket": o.task.bucket,
                     "heuristic_ms": rounded(o.heuristic_ms), "tuned_ms": rounded(tuned),
                     "speedup": round(o.heuristic_ms / tuned, 3) if tuned and o.heuristic_ms else None,
                     "before_ms": rounded(o.before_ms),
                     "vs_before": round(o.before_ms / chosen, 3) if o.before_ms and chosen else None,
                     "rejected": len(o.rejected) if o.tried else None,
                     "result": o.status if not o.note or o.status == "tuned" else f"{o.status}: {o.note}"})
    return rows


SUMMARY_COLUMNS = ["op", "shape", "bucket", "heuristic_ms", "tuned_ms", "speedup", "before_ms", "vs_before",
                   "rejected", "result"]


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def geomean_speedup(outcomes: list[Outcome]) -> float | None:
    """Geometric mean over the buckets measured in this run of heuristic / chosen time (1 where the heuristic
    stays)."""
    return geomean([o.heuristic_ms / o.tuned_ms if o.status == "tuned" else 1.0 for o in outcomes
                    if o.status in ("tuned", "heuristic") and o.heuristic_ms])
