"""One current table of measured figures, from the benchmark records in ``tuning/results/``.

``python -m tuning.results_table`` reads every benchmark record (the JSON files ``tuning._bench.write_results``
writes: ``name, device, date, torch, triton, meta, rows``; other JSON files there, such as experiment logs, are
skipped), keeps the latest measurement of every point (a GDN prefill shape, a decode batch, a MoE shape and token
count, a whole-model row) and writes ``tuning/RESULTS.md``: per device, one table per topic, every figure naming
the record it comes from.

"Latest" orders records by their date, then by the session and call that produced them (from the
``gpu_suite_s<N>`` index files, which list each call's result files in order; else the ``_s<N>`` in the file
name), then by file name. So a newer quick set replaces the rows it re-measured and leaves the others of an older
full set standing, each citing its own record.

``--check`` writes nothing and exits 1 when the file on disk differs from what the records give (a test runs it).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
DEFAULT_RESULTS = ROOT / "results"
DEFAULT_OUT = ROOT / "RESULTS.md"

#: MoE token counts of the benchmark's grid; other counts (one-off sweeps) stay in their records.
MOE_MS = (1, 4, 16, 64, 256, 1024, 4096, 16384)

_SESSION = re.compile(r"_s(\d+)")
_RECORD_KEYS = ("name", "device", "date", "rows")


class ResultsError(ValueError):
    """A results directory or record that cannot be turned into the table."""


@dataclass
class Record:
    """One benchmark record file."""

    path: Path
    device: str
    date: str
    torch: str
    triton: str
    meta: dict
    rows: list[dict]
    order: tuple = field(default=())

    @property
    def file(self) -> str:
        return self.path.name


def _suite_calls(results: Path) -> dict[str, tuple[int, int]]:
    """Map result file name -> (session, call) from the ``gpu_suite*.json`` index files."""
    order: dict[str, tuple[int, int]] = {}
    for path in sorted(results.glob("gpu_suite*.json")):
        doc = _read_json(path)
        if not isinstance(doc, dict) or not isinstance(doc.get("calls"), list):
            continue
        session = doc.get("session")
        if not isinstance(session, int):
            continue
        for call in doc["calls"]:
            if not isinstance(call, dict):
                continue
            number = call.get("call") if isinstance(call.get("call"), int) else 0
            for entry in call.get("results") or []:
                if isinstance(entry, str) and entry.strip():
                    order[entry.split()[0]] = (session, number)
    return order


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc})") from exc


def _check_finite(path: Path, row: dict) -> None:
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ResultsError(
                f"{path}: row op={row.get('op')!r} shape={row.get('shape')!r} has {key}={value}; "
                "a record holds finite numbers only"
            )


def load_records(results: str | Path) -> list[Record]:
    """Every benchmark record under ``results``, oldest first."""
    results = Path(results)
    if not results.is_dir():
        raise ResultsError(f"results directory {results} does not exist")
    calls = _suite_calls(results)
    records = []
    for path in sorted(results.glob("*.json")):
        doc = _read_json(path)
        if not isinstance(doc, dict) or any(k not in doc for k in _RECORD_KEYS) or not isinstance(doc["rows"], list):
            continue
        rows = [r for r in doc["rows"] if isinstance(r, dict) and isinstance(r.get("op"), str)]
        if path.name in calls:
            session, call = calls[path.name]
        else:
            match = _SESSION.search(path.stem)
            session, call = (int(match.group(1)) if match else 0), 0
        records.append(
            Record(
                path=path,
                device=str(doc["device"]),
                date=str(doc["date"]),
                torch=str(doc.get("torch", "?")),
                triton=str(doc.get("triton", "?")),
                meta=doc.get("meta") if isinstance(doc.get("meta"), dict) else {},
                rows=rows,
                order=(str(doc["date"]), session, call, path.name),
            )
        )
    if not records:
        raise ResultsError(f"{results} holds no benchmark records (JSON files with {', '.join(_RECORD_KEYS)})")
    records.sort(key=lambda r: r.order)
    return records


def latest(
    records: list[Record], select: Callable[[dict], bool], key: Callable[[dict], tuple]
) -> dict[tuple, tuple[dict, Record]]:
    """``key(row) -> (row, record)`` for the newest record holding each selected row's key.

    A selected row with a NaN or infinite number is an error naming its file: the table shows only finite figures.
    """
    out: dict[tuple, tuple[dict, Record]] = {}
    for record in records:  # oldest first: later records overwrite
        for row in record.rows:
            if select(row):
                _check_finite(record.path, row)
                out[key(row)] = (row, record)
    return out


# ---------------------------------------------------------------------------------------------- formatting


def _time(ms: float) -> str:
    if ms < 1.0:
        us = ms * 1000.0
        return f"{us:.2f} µs" if us < 100 else f"{us:.1f} µs" if us < 1000 else f"{us:.0f} µs"
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:.2f} ms"


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


class _Sources:
    """Numbers the records a table cites; a cell names its record by number once a table cites more than one."""

    def __init__(self, cells: list[tuple[dict, Record]]):
        self.records: list[Record] = []
        for _, record in cells:
            if record not in self.records:
                self.records.append(record)
        self.records.sort(key=lambda r: r.order)

    def mark(self, record: Record) -> str:
        return f" [{self.records.index(record) + 1}]" if len(self.records) > 1 else ""

    def lines(self) -> list[str]:
        out = []
        for i, record in enumerate(self.records, 1):
            tag = f"[{i}] " if len(self.records) > 1 else ""
            out.append(f"{tag}Source: `{record.file}` ({record.date}, torch {record.torch}, Triton {record.triton}).")
        return out


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _anchor_note(rows: list[dict]) -> str:
    sources = {str(r.get("anchor_source") or "measured in the same process") for r in rows}
    said = []
    for source in sorted(sources):
        if "DESIGN" in source or "table" in source:
            said.append("the reference figures for FLA 0.6.0 on this GPU (its kernels' GPU time, no host work)")
        else:
            said.append(source)
    return "; ".join(said)


def _order_key(text: str) -> tuple:
    """Sort ``27B-TP1``, ``397B-TP8``, ``1x8192``, ``B=16`` by their numbers, then their text."""
    return tuple(int(n) for n in re.findall(r"\d+", text)), text


# -------------------------------------------------------------------------------------------------- topics


def _seqs_key(seqs: str) -> tuple:
    """``1x2048 < 1x8192 < ... < 8x4096 < 64x512``: one sequence first, then by tokens, then by sequences."""
    n, _, t = seqs.partition("x")
    if not (n.isdigit() and t.isdigit()):
        return (2, 0, 0, seqs)
    return (int(n) > 1, int(n) * int(t), int(n), seqs)


def _gdn_heads_seqs(row: dict) -> tuple[str, str]:
    parts = str(row["shape"]).split()
    return str(row.get("heads") or parts[0]), str(row.get("seqs") or parts[-1])


def _gdn_prefill(records: list[Record]) -> list[str]:
    cells = latest(records, lambda r: r["op"] == "gdn_chunk_prefill", _gdn_heads_seqs)
    if not cells:
        return []
    src = _Sources(list(cells.values()))
    heads = sorted({h for h, _ in cells}, key=_order_key)
    seqs = sorted({s for _, s in cells}, key=_seqs_key)
    body = []
    for h in heads:
        line = [h]
        for s in seqs:
            if (h, s) in cells:
                row, record = cells[(h, s)]
                line.append(f"{_time(row['ours_ms'])}, {_x(row.get('speedup'))}{src.mark(record)}")
            else:
                line.append("–")
        body.append(line)
    return [
        "### GDN prefill (`gdn_chunk_prefill`, bf16, K = V = 128)",
        "",
        "Time of one call from CUDA events (host work included), and the speedup over FLA's "
        f"`chunk_gated_delta_rule`; FLA figures: {_anchor_note([r for r, _ in cells.values()])}. "
        "Columns: sequences x tokens.",
        "",
        *_table(["heads"] + seqs, body),
        "",
        *src.lines(),
        "",
    ]


def _gdn_decode(records: list[Record]) -> list[str]:
    cells = latest(
        records,
        lambda r: r["op"] == "gdn_recurrent_step",
        lambda r: (
            str(r.get("heads") or str(r["shape"]).split()[0]),
            int(r.get("B") or str(r["shape"]).split("B=")[-1]),
        ),
    )
    if not cells:
        return []
    src = _Sources(list(cells.values()))
    heads = sorted({h for h, _ in cells}, key=_order_key)
    batches = sorted({b for _, b in cells})
    body = []
    for h in heads:
        line = [h]
        for b in batches:
            if (h, b) in cells:
                row, record = cells[(h, b)]
                text = f"{_time(row['ours_ms'])}, {_x(row.get('speedup'))}"
                if row.get("state_GBps") is not None and b >= 128:
                    text += f", {row['state_GBps'] / 1000:.2f} TB/s"
                line.append(text + src.mark(record))
            else:
                line.append("–")
        body.append(line)
    return [
        "### GDN decode step (`gdn_recurrent_step`, bf16, CUDA-graph replay)",
        "",
        "Time per step, speedup over FLA's `fused_recurrent_gated_delta_rule` measured in the same process, and "
        "from 128 sequences the state traffic (read + write of the fp32 state).",
        "",
        *_table(["heads"] + [f"B={b}" for b in batches], body),
        "",
        *src.lines(),
        "",
    ]


def _gdn_host(records: list[Record]) -> list[str]:
    cells = latest(records, lambda r: r["op"] == "gdn_chunk_prefill host cost", lambda r: (str(r["shape"]),))
    if not cells:
        return []
    src = _Sources(list(cells.values()))
    body = []
    for (shape,), (row, record) in sorted(cells.items(), key=lambda kv: _order_key(kv[0][0])):
        host = row.get("host_us")
        body.append([shape, _num(host, 1) + " µs" + src.mark(record)])
    return [
        "### GDN host cost per prefill call",
        "",
        "CPU time per call of back-to-back calls (median of rounds).",
        "",
        *_table(["shape", "host per call"], body),
        "",
        *src.lines(),
        "",
    ]


def _moe(records: list[Record]) -> list[str]:
    def select(row: dict) -> bool:
        return row["op"] == "moe_block_routed" and row.get("M") in MOE_MS

    cells = latest(records, select, lambda r: (str(r["shape"]).split(" M=")[0], int(r["M"])))
    if not cells:
        return []
    src = _Sources(list(cells.values()))
    body = []
    for (shape, m), (row, record) in sorted(cells.items(), key=lambda kv: (_order_key(kv[0][0]), kv[0][1])):
        tflops = row.get("TFLOPs")
        body.append(
            [
                shape,
                str(m),
                _time(row["ours_ms"]),
                str(row.get("method") or "–"),
                _time(row["anchor_ms"]) if row.get("anchor_ms") else "–",
                _x(row.get("speedup")),
                _x(row.get("x_mem_floor")) if m <= 16 else "–",
                _num(tflops) if m >= 1024 and tflops is not None else "–",
                f"{src.records.index(record) + 1}",
            ]
        )
    return [
        "### MoE block (`moe_block`, routed experts, bf16, routing included)",
        "",
        "Method `graph`: GPU time by CUDA-graph replay; `events`: one call from an idle GPU, host work included. "
        "Torch: a `torch._grouped_mm` pipeline on the same device. Weight-read floor: the bytes of the experts the "
        "routing picked, plus the router, at the measured copy rate.",
        "",
        *_table(["shape", "M", "ours", "method", "torch", "x torch", "x weight-read floor", "TFLOP/s", "src"], body),
        "",
        *[line if len(src.records) > 1 else "[1] " + line for line in src.lines()],
        "",
    ]


def _model(records: list[Record]) -> list[str]:
    cells = latest(
        records,
        lambda r: r["op"] in ("prefill", "decode") and bool(r.get("mode")),  # rows without a mode: older format
        lambda r: (r["op"], str(r["shape"]), str(r.get("mode") or ""), str(r.get("tokens") or "")),
    )
    if not cells:
        return []
    src = _Sources(list(cells.values()))
    body = []
    for (op, shape, mode, tokens), (row, record) in sorted(
        cells.items(), key=lambda kv: (kv[0][0] != "prefill", _order_key(kv[0][1]), kv[0][2], kv[0][3])
    ):
        how = mode + (f", {tokens}" if tokens else "")
        body.append(
            [
                f"{op} {shape}",
                how,
                _time(row["ours_ms"]),
                _num(row.get("tok_s")),
                _x(row.get("speedup")),
                f"{src.records.index(record) + 1}",
            ]
        )
    width = next((r.meta for r in src.records if r.meta.get("layers")), {})
    layers = f"{width['layers']} layers, " if width.get("layers") else ""
    return [
        "### Whole model (standalone host, Qwen3.5-35B-A3B width, random weights)",
        "",
        f"{layers}bf16. Prefill: one step from an idle GPU, or 5 steps back to back (which holds the GPU at its "
        "power cap). Decode at 4096 tokens of context, eager or one CUDA-graph replay per step. x HF: against HF "
        "transformers' figures for the same model.",
        "",
        *_table(["row", "mode", "time per step", "tokens/s", "x HF", "src"], body),
        "",
        *[line if len(src.records) > 1 else "[1] " + line for line in src.lines()],
        "",
    ]


TOPICS = (_gdn_prefill, _gdn_decode, _gdn_host, _moe, _model)


def render(results: str | Path = DEFAULT_RESULTS) -> str:
    """The text of RESULTS.md for the records under ``results``."""
    records = load_records(results)
    lines = [
        "# Measured figures",
        "",
        "Generated by `python -m tuning.results_table` from the latest benchmark records in `tuning/results/`; "
        "do not edit by hand. Each table names the record every figure comes from. How the figures were "
        "measured, what limits them and what was tried: `tuning/notes_gdn.md`, `tuning/notes_moe.md`, "
        "`tuning/notes_model.md`.",
        "",
    ]
    for device in sorted({r.device for r in records}):
        mine = [r for r in records if r.device == device]
        sections = [line for topic in TOPICS for line in topic(mine)]
        if sections:
            lines += [f"## {device}", "", *sections]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tuning.results_table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(DEFAULT_RESULTS), help="directory of result JSON files")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="Markdown file to write")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when --out is not current")
    args = ap.parse_args(argv)
    try:
        text = render(args.results)
    except ResultsError as exc:
        print(f"results_table: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    if args.check:
        current = out.read_text() if out.is_file() else None
        if current != text:
            print(f"results_table: {out} is not current; run `python -m tuning.results_table`", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
