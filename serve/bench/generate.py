"""Synthetic chat request sets for `qwen35-bench replay`.

Each line of the output JSONL is a chat completion body without `model` / `stream` (the replayer
sets those). The mix imitates production traffic: prompt and output lengths are log-normal (a long
tail), a few long system prompts are shared by many requests (so prefix caching has hits, the
popular ones more often — Zipf-like), a share of requests are multi-turn conversations, and a share
offer tools, some with an earlier tool call and its result in the history. The same arguments and
seed always give the same file.

`fit_requests` then fits each request into a server's context (`max_model_len`): `max_tokens` is
capped at a quarter of the context, and a prompt that would not leave room for it is shortened:
earlier turns first (the longest text first), the shared system prompt last. Prompt sizes are
counted exactly by the server's `/tokenize` when a counter is given, else estimated from word
counts (`TOKENS_PER_WORD`, set high enough for the embedded toy tokenizer, so the estimate fits too).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serve.accept.checks_structured import SEARCH_TOOL, WEATHER_TOOL
from serve.embedded.corpus import CORPUS

WORDS = sorted(set(re.findall(r"[A-Za-z]{2,}", CORPUS)))

TOOL_POOL = [
    WEATHER_TOOL,
    SEARCH_TOOL,
    {
        "type": "function",
        "function": {
            "name": "run_sql",
            "description": "Run a read-only SQL query against the analytics database.",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "send_email",
            "description": "Send an email to one recipient.",
            "parameters": {
                "type": "object",
                "properties": {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
                "required": ["to", "subject", "body"],
            },
        },
    },
]


@dataclass(frozen=True)
class MixConfig:
    """Shape of a synthetic request set. Word counts are words of prose (about 1.3-2 tokens each)."""

    num_requests: int = 200
    seed: int = 0
    system_prompts: int = 4
    system_words: int = 400
    prompt_words_median: int = 120
    prompt_words_max: int = 4000
    output_tokens_median: int = 192
    output_tokens_max: int = 2048
    sigma: float = 1.0
    """Log-normal shape for prompt and output lengths; larger means a longer tail."""
    multi_turn_share: float = 0.3
    max_prior_turns: int = 4
    turn_words_median: int = 60
    """Median words of each earlier user or assistant turn in a multi-turn conversation."""
    tool_share: float = 0.2
    max_tools: int = len(TOOL_POOL)
    """Upper bound on tool definitions per request (1 .. max_tools, uniformly)."""
    temperature: float = 0.7

    def __post_init__(self) -> None:
        positive = (
            "num_requests",
            "system_words",
            "prompt_words_median",
            "output_tokens_median",
            "max_prior_turns",
            "turn_words_median",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("multi_turn_share", "tool_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1]")
        if not 1 <= self.max_tools <= len(TOOL_POOL):
            raise ValueError(f"max_tools={self.max_tools} must be in [1, {len(TOOL_POOL)}]")
        if self.system_prompts < 0 or self.sigma < 0:
            raise ValueError(f"system_prompts={self.system_prompts} and sigma={self.sigma} must be >= 0")
        if self.prompt_words_max < self.prompt_words_median or self.output_tokens_max < self.output_tokens_median:
            raise ValueError("the maxima must not be below the medians")


def _long_tailed(rng: random.Random, median: int, maximum: int, sigma: float, minimum: int = 1) -> int:
    return max(minimum, min(maximum, round(rng.lognormvariate(math.log(median), sigma))))


def _prose(rng: random.Random, words: int) -> str:
    """`words` words of sentence-shaped filler text."""
    out: list[str] = []
    while len(out) < words:
        sentence = [rng.choice(WORDS) for _ in range(min(rng.randint(6, 18), words - len(out)))]
        sentence[0] = sentence[0].capitalize()
        out.extend(sentence[:-1] + [sentence[-1] + "."])
    return " ".join(out)


def _system_prompt(rng: random.Random, index: int, words: int) -> str:
    return f"You are assistant #{index} of the support team. Follow these house rules.\n\n" + _prose(rng, words)


def _prior_turns(rng: random.Random, config: MixConfig) -> list[dict]:
    turns: list[dict] = []
    for _ in range(rng.randint(1, config.max_prior_turns)):
        for role in ("user", "assistant"):
            words = _long_tailed(rng, config.turn_words_median, 8 * config.turn_words_median, config.sigma)
            turns.append({"role": role, "content": _prose(rng, words)})
    return turns


def _tool_history(rng: random.Random, tools: list[dict]) -> list[dict]:
    """A user turn answered by a tool call (content null) and the tool's result."""
    tool = rng.choice(tools)["function"]
    arguments = {name: _prose(rng, 3).rstrip(".") for name in tool["parameters"]["required"]}
    call_id = f"call_{rng.randrange(16**8):08x}"
    return [
        {"role": "user", "content": _prose(rng, 20)},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": tool["name"], "arguments": json.dumps(arguments)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": json.dumps({"result": _prose(rng, 30)})},
    ]


def generate_requests(config: MixConfig) -> list[dict]:
    """The request bodies of one synthetic set."""
    rng = random.Random(config.seed)
    systems = [_system_prompt(rng, i, config.system_words) for i in range(config.system_prompts)]
    popularity = [1.0 / (rank + 1) for rank in range(len(systems))]  # Zipf: the first prefix is the hottest
    requests = []
    for _ in range(config.num_requests):
        messages: list[dict] = []
        if systems:
            messages.append({"role": "system", "content": rng.choices(systems, weights=popularity)[0]})
        body: dict = {}
        if rng.random() < config.tool_share:
            body["tools"] = rng.sample(TOOL_POOL, rng.randint(1, config.max_tools))
            body["tool_choice"] = "auto"
            if rng.random() < 0.5:
                messages.extend(_tool_history(rng, body["tools"]))
        if rng.random() < config.multi_turn_share:
            messages.extend(_prior_turns(rng, config))
        prompt_words = _long_tailed(rng, config.prompt_words_median, config.prompt_words_max, config.sigma)
        messages.append({"role": "user", "content": _prose(rng, prompt_words)})
        body = {
            "messages": messages,
            **body,
            "max_tokens": _long_tailed(rng, config.output_tokens_median, config.output_tokens_max, config.sigma),
            "temperature": config.temperature,
        }
        requests.append(body)
    return requests


def write_requests(path: Path, requests: list[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for body in requests:
            handle.write(json.dumps(body, ensure_ascii=False) + "\n")


def read_requests(path: Path) -> list[dict]:
    """Chat request bodies from a JSONL file (blank lines ignored); each must have `messages`."""
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'messages' list")
        requests.append(body)
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


# -- fitting into a context ----------------------------------------------------------------------

TOKENS_PER_WORD = 3.2
"""Estimated prompt tokens per word of the generated prose, on the high side: the embedded toy
tokenizer gives 2.6-3.1 on it, Qwen's own tokenizers far fewer."""
MESSAGE_OVERHEAD = 8
"""Estimated template tokens around each message (role markers, newlines)."""
OUTPUT_SHARE = 4
"""`max_tokens` is capped at max_model_len // OUTPUT_SHARE."""


def estimate_prompt_tokens(body: dict, tokens_per_word: float = TOKENS_PER_WORD) -> int:
    """An upper estimate of the prompt tokens of a chat body: words of every message, the tool
    definitions and call arguments at ~3 characters a token, and a few tokens per message."""
    total = 16 + sum(len(json.dumps(t)) // 3 for t in body.get("tools") or [])
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            total += math.ceil(len(content.split()) * tokens_per_word)
        for call in message.get("tool_calls") or []:
            total += len(json.dumps(call)) // 3
        total += MESSAGE_OVERHEAD
    return total


@dataclass
class FitReport:
    max_model_len: int
    shortened: int = 0
    """Requests whose prompt was shortened."""
    capped: int = 0
    """Requests whose max_tokens was lowered."""
    exact: bool = False
    """Whether prompt sizes came from the server's tokenizer."""


def _shorten(body: dict, words_to_cut: int) -> bool:
    """Cut `words_to_cut` words (at least one, never the last one) from the end of the longest text
    message, non-system ones first; False when nothing is left to cut."""
    candidates = [m for m in body["messages"] if isinstance(m.get("content"), str) and len(m["content"].split()) > 1]
    if not candidates:
        return False
    others = [m for m in candidates if m["role"] != "system"]
    message = max(others or candidates, key=lambda m: len(m["content"].split()))
    words = message["content"].split()
    keep = max(1, min(len(words) - 1, len(words) - words_to_cut))
    message["content"] = " ".join(words[:keep])
    return True


def fit_requests(
    requests: list[dict],
    max_model_len: int,
    count_tokens: Callable[[dict], int] | None = None,
    tokens_per_word: float = TOKENS_PER_WORD,
) -> tuple[list[dict], FitReport]:
    """Copies of `requests` that each fit `max_model_len`: prompt tokens + max_tokens <= max_model_len.

    `count_tokens(body)` gives the exact prompt size (e.g. the server's `/tokenize`); without it
    the size is estimated. Raises ValueError naming the request when even a one-word prompt is too
    long (the system prompt and tools alone exceed the context).
    """
    if max_model_len < 2 * OUTPUT_SHARE:
        raise ValueError(f"max_model_len={max_model_len} is too small to fit requests (at least {2 * OUTPUT_SHARE})")
    report = FitReport(max_model_len, exact=count_tokens is not None)
    count = count_tokens or (lambda body: estimate_prompt_tokens(body, tokens_per_word))
    fitted = []
    for index, original in enumerate(requests):
        body = json.loads(json.dumps(original))
        cap = max_model_len // OUTPUT_SHARE
        if body.get("max_tokens", 0) > cap:
            body["max_tokens"] = cap
            report.capped += 1
        budget = max_model_len - body.get("max_tokens", 0)
        size = count(body)
        shortened = False
        while size > budget:
            if not _shorten(body, math.ceil((size - budget) / 1.2)):  # >= 1.2 tokens a word: few rounds
                raise ValueError(
                    f"request {index} cannot fit max_model_len={max_model_len}: its prompt needs {size} "
                    f"tokens with every message cut to one word, {budget} are left after max_tokens"
                )
            shortened = True
            size = count(body)
        report.shortened += shortened
        fitted.append(body)
    return fitted, report
