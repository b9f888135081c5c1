"""Chat completion checks: shapes, streaming, usage, n, token limits, stop strings, sampling, logprobs."""

from __future__ import annotations

import re

from serve.accept.suite import (
    DROP,
    PROTOCOL,
    Suite,
    assemble,
    check,
    choice,
    content,
    expect,
    expect_chat_completion,
    expect_finish_rule,
    expect_finite_logprob,
    expect_token_count,
    first_difference,
    logprob_entries,
    skip,
    stream_usages,
    usage,
)

# -- basic chat ----------------------------------------------------------------------------------


@check("chat_basic", PROTOCOL, "non-streamed chat: chat.completion object, one assistant choice, usage")
def chat_basic(suite: Suite) -> str:
    reply = suite.chat(suite.request())
    expect_chat_completion(reply, suite.model)
    return f"{usage(reply)['completion_tokens']} tokens"


@check(
    "chat_usage_counts", PROTOCOL, "usage.completion_tokens equals the generated tokens; total = prompt + completion"
)
def chat_usage_counts(suite: Suite) -> None:
    reply = suite.reference()
    counts = usage(reply)
    expect(counts["prompt_tokens"] > 0, "usage.prompt_tokens", "is 0 for a non-empty prompt")
    expect(counts["completion_tokens"] > 0, "usage.completion_tokens", "is 0 although text was generated")
    first = choice(reply)
    generated = len(logprob_entries(first, "choices[0]"))
    expect_token_count(counts["completion_tokens"], generated, first.get("finish_reason"), "usage.completion_tokens")


@check("chat_unique_ids", PROTOCOL, "two completions get different ids")
def chat_unique_ids(suite: Suite) -> None:
    first = suite.chat(suite.request(max_tokens=1))
    second = suite.chat(suite.request(max_tokens=1))
    expect(first.get("id") != second.get("id"), "id", f"both replies have id {first.get('id')!r}")


@check("chat_content_parts", PROTOCOL, "user content as a list of text parts means the same prompt as a string")
def chat_content_parts(suite: Suite) -> None:
    text = "Describe a sunset over the sea."
    plain = suite.chat(suite.request(text, max_tokens=1))
    parts = [{"type": "text", "text": text}]
    as_parts = suite.chat(suite.request(messages=[{"role": "user", "content": parts}], max_tokens=1))
    expect(
        usage(as_parts)["prompt_tokens"] == usage(plain)["prompt_tokens"],
        "usage.prompt_tokens",
        f"{usage(as_parts)['prompt_tokens']} with content parts vs {usage(plain)['prompt_tokens']} with a string",
    )


@check("system_prompt_used", PROTOCOL, "a system message reaches the prompt (prompt_tokens grows)")
def system_prompt_used(suite: Suite) -> None:
    without = suite.chat(suite.request(max_tokens=1))
    messages = [
        {"role": "system", "content": "You are a pirate. Answer every question in the voice of a pirate."},
        {"role": "user", "content": suite.request()["messages"][0]["content"]},
    ]
    with_system = suite.chat(suite.request(messages=messages, max_tokens=1))
    expect(
        usage(with_system)["prompt_tokens"] > usage(without)["prompt_tokens"],
        "usage.prompt_tokens",
        f"{usage(with_system)['prompt_tokens']} with a system message, {usage(without)['prompt_tokens']} without",
    )


# -- streaming -----------------------------------------------------------------------------------


@check("stream_basic", PROTOCOL, "streamed chat: SSE content type, chunk objects, one id, role first, [DONE] last")
def stream_basic(suite: Suite) -> None:
    reply = suite.stream(suite.request())
    expect(reply.content_type.startswith("text/event-stream"), "content-type", f"got {reply.content_type!r}")
    expect(reply.chunks, "stream", "no data chunks before [DONE]")
    expect(reply.done, "stream", "did not end with data: [DONE]")
    expect(reply.after_done == 0, "stream", f"{reply.after_done} data lines after [DONE]")
    ids = {chunk.get("id") for chunk in reply.chunks}
    expect(len(ids) == 1 and None not in ids, "chunk.id", f"expected one id across chunks, got {sorted(map(str, ids))}")
    for n, chunk in enumerate(reply.chunks):
        expect(chunk.get("object") == "chat.completion.chunk", f"chunk[{n}].object", f"got {chunk.get('object')!r}")
        expect(isinstance(chunk.get("created"), int), f"chunk[{n}].created", f"got {chunk.get('created')!r}")
        expect(chunk.get("model", "").startswith(suite.model), f"chunk[{n}].model", f"got {chunk.get('model')!r}")
    streamed = assemble(reply)
    expect(set(streamed) == {0}, "chunk.choices[].index", f"expected only index 0, got {sorted(streamed)}")
    expect(streamed[0].role == "assistant", "delta.role", f"first role is {streamed[0].role!r}, expected 'assistant'")


@check("stream_single_finish", PROTOCOL, "each streamed choice has exactly one finish_reason, after its last delta")
def stream_single_finish(suite: Suite) -> None:
    streamed = assemble(suite.stream(suite.request()))
    reasons = streamed.get(0, None)
    expect(reasons is not None, "chunk.choices", "no chunk for choice 0")
    expect(len(reasons.finish_reasons) == 1, "finish_reason", f"choice 0 got {reasons.finish_reasons}")
    expect(reasons.deltas_after_finish == 0, "delta", f"{reasons.deltas_after_finish} deltas after the finish_reason")


@check("stream_matches_nonstream", PROTOCOL, "greedy streamed text equals the greedy non-streamed text")
def stream_matches_nonstream(suite: Suite) -> None:
    reference = suite.reference()
    streamed = assemble(suite.stream(suite.request(logprobs=True)))[0]
    expected = content(reference)
    expect(
        streamed.content == expected, "delta.content", "streamed text " + first_difference(streamed.content, expected)
    )
    expect(
        streamed.finish_reasons == [choice(reference).get("finish_reason")],
        "finish_reason",
        f"stream {streamed.finish_reasons}, non-stream {choice(reference).get('finish_reason')!r}",
    )


@check("stream_no_usage_by_default", PROTOCOL, "without stream_options.include_usage no chunk carries usage")
def stream_no_usage_by_default(suite: Suite) -> None:
    found = stream_usages(suite.stream(suite.request()))
    expect(not found, f"chunk[{found[0][0]}].usage" if found else "usage", "usage sent without include_usage")


@check("stream_include_usage", PROTOCOL, "include_usage: usage once, in a last chunk with no choices, counts match")
def stream_include_usage(suite: Suite) -> None:
    reference = usage(suite.reference())
    reply = suite.stream(suite.request(logprobs=True, stream_options={"include_usage": True}))
    found = stream_usages(reply)
    expect(len(found) == 1, "usage", f"expected exactly one usage chunk, got {len(found)}")
    position, counts = found[0]
    expect(position == len(reply.chunks) - 1, f"chunk[{position}].usage", "usage chunk is not the last chunk")
    expect(
        reply.chunks[position].get("choices") == [], f"chunk[{position}].choices", "usage chunk must have choices: []"
    )
    for key in ("prompt_tokens", "completion_tokens"):
        expect(
            counts.get(key) == reference[key], f"usage.{key}", f"stream {counts.get(key)}, non-stream {reference[key]}"
        )
    expect(
        counts.get("total_tokens") == counts.get("prompt_tokens", 0) + counts.get("completion_tokens", 0),
        "usage.total_tokens",
        f"{counts.get('total_tokens')} != prompt + completion",
    )
    streamed = assemble(reply)[0]
    expect_token_count(
        counts["completion_tokens"],
        streamed.logprob_entries,
        (streamed.finish_reasons or [None])[0],
        "usage.completion_tokens",
    )


# -- n > 1 ---------------------------------------------------------------------------------------


@check("n2_choices", PROTOCOL, "n=2: two distinct choices with indices 0 and 1; usage counts both")
def n2_choices(suite: Suite) -> None:
    reply = suite.chat(suite.request(n=2, temperature=1.0, max_tokens=16, logprobs=True))
    expect_chat_completion(reply, suite.model, n=2)
    texts = [content(reply, i) for i in range(2)]
    expect(
        texts[0] != texts[1],
        "choices[1].message.content",
        f"identical to choices[0] at temperature 1: {texts[0]!r:.60}",
    )
    generated = sum(len(logprob_entries(choice(reply, i), f"choices[{i}]")) for i in range(2))
    stops = sum(choice(reply, i).get("finish_reason") == "stop" for i in range(2))
    completion = usage(reply)["completion_tokens"]
    expect(
        generated <= completion <= generated + stops,
        "usage.completion_tokens",
        f"{completion}, but the two choices generated {generated} tokens (by logprob entries)",
    )


@check("n2_stream", PROTOCOL, "streamed n=2: both indices stream, one finish_reason each, usage counts both")
def n2_stream(suite: Suite) -> None:
    body = suite.request(n=2, temperature=1.0, logprobs=True, stream_options={"include_usage": True})
    reply = suite.stream(body)
    expect(reply.done, "stream", "did not end with data: [DONE]")
    streamed = assemble(reply)
    expect(sorted(streamed) == [0, 1], "chunk.choices[].index", f"expected indices [0, 1], got {sorted(streamed)}")
    for index, part in streamed.items():
        expect(len(part.finish_reasons) == 1, f"choices[{index}].finish_reason", f"got {part.finish_reasons}")
    found = stream_usages(reply)
    expect(len(found) == 1, "usage", f"expected one usage chunk, got {len(found)}")
    completion = found[0][1].get("completion_tokens")
    generated = sum(part.logprob_entries for part in streamed.values())
    stops = sum(part.finish_reasons == ["stop"] for part in streamed.values())
    expect(
        isinstance(completion, int) and generated <= completion <= generated + stops,
        "usage.completion_tokens",
        f"{completion}, but the two choices streamed {generated} tokens",
    )


# -- token limits --------------------------------------------------------------------------------


@check("max_tokens_1", PROTOCOL, "max_tokens=1: one token, finish_reason length (or stop on end-of-sequence)")
def max_tokens_1(suite: Suite) -> None:
    reply = suite.chat(suite.request(max_tokens=1))
    expect_finish_rule(choice(reply).get("finish_reason"), usage(reply)["completion_tokens"], 1, "choices[0]")
    expect(
        usage(reply)["completion_tokens"] == 1, "usage.completion_tokens", f"{usage(reply)['completion_tokens']} != 1"
    )


@check("max_tokens_64", PROTOCOL, "max_tokens=64: at most 64 tokens; length exactly when cut")
def max_tokens_64(suite: Suite) -> str:
    reply = suite.chat(suite.request(max_tokens=64))
    expect_finish_rule(choice(reply).get("finish_reason"), usage(reply)["completion_tokens"], 64, "choices[0]")
    return f"{usage(reply)['completion_tokens']} tokens, {choice(reply).get('finish_reason')}"


@check("max_tokens_absent", PROTOCOL, "no max_tokens: the reply ends by stop, or by length at the context limit")
def max_tokens_absent(suite: Suite) -> str:
    body = suite.request("Say hello in one short sentence.", max_tokens=DROP)
    reply = suite.chat(body)
    counts = usage(reply)
    finish = choice(reply).get("finish_reason")
    expect(finish in ("stop", "length"), "choices[0].finish_reason", f"expected stop or length, got {finish!r}")
    if finish == "length":
        if suite.max_model_len is None:
            skip("cut by length and the context size is unknown (pass --max-model-len)")
        expect(
            counts["total_tokens"] == suite.max_model_len,
            "choices[0].finish_reason",
            f"'length' with {counts['total_tokens']} tokens in context, limit is {suite.max_model_len}",
        )
    return f"{counts['completion_tokens']} tokens, {finish}"


@check("max_completion_tokens", PROTOCOL, "max_completion_tokens=8 limits the reply like max_tokens")
def max_completion_tokens(suite: Suite) -> None:
    reply = suite.chat(suite.request(max_tokens=DROP, max_completion_tokens=8))
    expect_finish_rule(choice(reply).get("finish_reason"), usage(reply)["completion_tokens"], 8, "choices[0]")


# -- stop strings --------------------------------------------------------------------------------


def _stop_candidates(text: str) -> list[tuple[int, str]]:
    """(first position, stop string) for short alphanumeric runs that start after the first char."""
    found: dict[str, int] = {}
    for match in re.finditer(r"[A-Za-z0-9]{2,}", text):
        stop = match.group()[:4]
        position = text.find(stop)
        if position > 0 and stop not in found:
            found[stop] = position
    return sorted((position, stop) for stop, position in found.items())


def _stop_plan(suite: Suite) -> tuple[str, list[tuple[int, str]]]:
    text = content(suite.reference())
    candidates = _stop_candidates(text)
    if not candidates:
        skip(f"the greedy reply has no alphanumeric run to use as a stop string: {text!r:.80}")
    return text, candidates


@check("stop_nonstream", PROTOCOL, "stop string: text ends right before it, finish_reason stop, no leak")
def stop_nonstream(suite: Suite) -> str:
    text, candidates = _stop_plan(suite)
    position, stop = candidates[len(candidates) // 2]
    reply = suite.chat(suite.request(stop=[stop]))
    got = content(reply)
    expect(stop not in got, "choices[0].message.content", f"contains the stop string {stop!r}: {got!r:.80}")
    expect(got == text[:position], "choices[0].message.content", first_difference(got, text[:position]))
    expect(
        choice(reply).get("finish_reason") == "stop",
        "choices[0].finish_reason",
        f"got {choice(reply).get('finish_reason')!r}",
    )
    return f"stop {stop!r}"


@check("stop_stream", PROTOCOL, "stop string while streaming: no part of it is streamed, finish_reason stop")
def stop_stream(suite: Suite) -> str:
    text, candidates = _stop_plan(suite)
    position, stop = candidates[len(candidates) // 2]
    streamed = assemble(suite.stream(suite.request(stop=[stop])))[0]
    expect(stop not in streamed.content, "delta.content", f"streamed the stop string {stop!r}")
    expect(streamed.content == text[:position], "delta.content", first_difference(streamed.content, text[:position]))
    expect(streamed.finish_reasons == ["stop"], "finish_reason", f"got {streamed.finish_reasons}")
    return f"stop {stop!r}"


@check("stop_multiple", PROTOCOL, "several stop strings: the earliest one in the text ends the reply")
def stop_multiple(suite: Suite) -> None:
    text, candidates = _stop_plan(suite)
    if len(candidates) < 2:
        skip("the greedy reply offers fewer than two stop strings")
    (first_position, first), (_, later) = candidates[0], candidates[-1]
    got = content(suite.chat(suite.request(stop=[later, first])))
    expect(got == text[:first_position], "choices[0].message.content", first_difference(got, text[:first_position]))


# -- sampling ------------------------------------------------------------------------------------


@check("temperature0_deterministic", PROTOCOL, "two greedy requests give the same text")
def temperature0_deterministic(suite: Suite) -> None:
    body = suite.request(max_tokens=32)
    first, second = content(suite.chat(body)), content(suite.chat(body))
    expect(first == second, "choices[0].message.content", "second greedy reply " + first_difference(second, first))


@check("seed_reproducible", PROTOCOL, "temperature 1 with the same seed gives the same text")
def seed_reproducible(suite: Suite) -> None:
    body = suite.request(temperature=1.0, seed=1234, max_tokens=24)
    first, second = content(suite.chat(body)), content(suite.chat(body))
    expect(first == second, "choices[0].message.content", "same seed, " + first_difference(second, first))


def _sampled_ok(suite: Suite, **fields) -> str:
    reply = suite.chat(suite.request(temperature=0.8, **fields))
    expect_chat_completion(reply, suite.model)
    return ", ".join(f"{k}={v}" for k, v in fields.items())


@check("top_p_accepted", PROTOCOL, "top_p is accepted")
def top_p_accepted(suite: Suite) -> str:
    return _sampled_ok(suite, top_p=0.5)


@check("top_k_accepted", PROTOCOL, "top_k (vLLM extension) is accepted")
def top_k_accepted(suite: Suite) -> str:
    return _sampled_ok(suite, top_k=5)


@check("penalties_accepted", PROTOCOL, "presence, frequency and repetition penalties are accepted")
def penalties_accepted(suite: Suite) -> str:
    return _sampled_ok(suite, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1)


@check("top_k_1_is_greedy", PROTOCOL, "temperature 1 with top_k=1 gives the greedy text")
def top_k_1_is_greedy(suite: Suite) -> None:
    reference = suite.reference()
    expected = content(reference)[: _untied_prefix(reference)]
    got = content(suite.chat(suite.request(temperature=1.0, top_k=1, seed=7)))[: len(expected)]
    expect(got == expected, "choices[0].message.content", "top_k=1 " + first_difference(got, expected))


def _untied_prefix(reply: dict) -> int:
    """Length of the text before the first token whose best two candidates tie exactly: past it,
    greedy picks by index and top_k=1 may keep both, so the two may rightly differ."""
    raw = bytearray()
    for entry in logprob_entries(choice(reply), "choices[0]"):
        top = [alt["logprob"] for alt in entry.get("top_logprobs") or []]
        if len(top) >= 2 and top[0] == top[1]:
            break
        raw += bytes(entry.get("bytes") or (entry.get("token") or "").encode())
    return len(raw.decode("utf-8", errors="ignore"))


# -- logprobs ------------------------------------------------------------------------------------


@check("logprobs_shape", PROTOCOL, "logprobs + top_logprobs=3: one entry per token, 3 sorted alternatives each")
def logprobs_shape(suite: Suite) -> None:
    reply = suite.chat(suite.request(max_tokens=8, logprobs=True, top_logprobs=3))
    entries = logprob_entries(choice(reply), "choices[0]")
    expect_token_count(
        usage(reply)["completion_tokens"], len(entries), choice(reply).get("finish_reason"), "usage.completion_tokens"
    )
    for i, entry in enumerate(entries):
        where = f"choices[0].logprobs.content[{i}]"
        expect(isinstance(entry.get("token"), str), f"{where}.token", f"not a string: {entry.get('token')!r}")
        expect_finite_logprob(entry.get("logprob"), f"{where}.logprob")
        raw = entry.get("bytes")
        expect(
            raw is None or (isinstance(raw, list) and all(isinstance(b, int) and 0 <= b < 256 for b in raw)),
            f"{where}.bytes",
            f"expected a list of byte values or null, got {raw!r:.60}",
        )
        top = entry.get("top_logprobs")
        expect(
            isinstance(top, list) and len(top) == 3, f"{where}.top_logprobs", f"expected 3 entries, got {top!r:.100}"
        )
        values = []
        for j, alt in enumerate(top):
            expect(isinstance(alt.get("token"), str), f"{where}.top_logprobs[{j}].token", "not a string")
            expect_finite_logprob(alt.get("logprob"), f"{where}.top_logprobs[{j}].logprob")
            values.append(alt["logprob"])
        expect(values == sorted(values, reverse=True), f"{where}.top_logprobs", f"not sorted by logprob: {values}")


@check("logprobs_greedy_is_top1", PROTOCOL, "at temperature 0 each chosen token is the most likely one")
def logprobs_greedy_is_top1(suite: Suite) -> None:
    reply = suite.chat(suite.request(max_tokens=8, logprobs=True, top_logprobs=2))
    for i, entry in enumerate(logprob_entries(choice(reply), "choices[0]")):
        best = max(alt["logprob"] for alt in entry.get("top_logprobs") or [{"logprob": entry["logprob"]}])
        expect(
            entry["logprob"] >= best - 1e-3,
            f"choices[0].logprobs.content[{i}].logprob",
            f"greedy token {entry.get('token')!r} has {entry['logprob']:.4f}, best alternative {best:.4f}",
        )


@check("logprobs_stream", PROTOCOL, "streamed logprobs: entries for every token, count matches usage")
def logprobs_stream(suite: Suite) -> None:
    reply = suite.stream(
        suite.request(max_tokens=8, logprobs=True, top_logprobs=2, stream_options={"include_usage": True})
    )
    streamed = assemble(reply)[0]
    found = stream_usages(reply)
    expect(found, "usage", "no usage chunk with include_usage")
    expect(streamed.logprob_entries > 0, "delta.logprobs", "no logprob entries were streamed")
    expect_token_count(
        found[-1][1].get("completion_tokens"),
        streamed.logprob_entries,
        (streamed.finish_reasons or [None])[0],
        "usage.completion_tokens",
    )
    for n, chunk in enumerate(reply.chunks):
        for c in chunk.get("choices") or []:
            for j, entry in enumerate((c.get("logprobs") or {}).get("content") or []):
                top = entry.get("top_logprobs")
                expect(
                    isinstance(top, list) and len(top) == 2,
                    f"chunk[{n}].logprobs.content[{j}].top_logprobs",
                    f"expected 2 entries, got {top!r:.80}",
                )


@check("logprobs_absent_by_default", PROTOCOL, "without logprobs the choice's logprobs is null")
def logprobs_absent_by_default(suite: Suite) -> None:
    reply = suite.chat(suite.request(max_tokens=2))
    value = choice(reply).get("logprobs")
    expect(value is None, "choices[0].logprobs", f"expected null, got {value!r:.80}")
