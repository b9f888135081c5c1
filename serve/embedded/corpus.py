# ruff: noqa: E501  (the corpus keeps its long JSON lines as they are)
"""Training text for the embedded tokenizer, written for this repository (no downloads).

A few kilobytes of plain English, chat turns in the Qwen format, JSON, Python and numbers, so the
byte-level BPE learns merges for the strings a chat server actually sees. The text is part of the
tokenizer's identity: changing it changes the vocabulary and therefore the checkpoint cache key.
"""

CORPUS = r"""
The serving kit answers requests from many clients at once. Each request carries a list of messages,
and the server turns them into a prompt with the chat template, runs the model, and streams the
answer back token by token. A good server is boring: it returns the same answer for the same greedy
request, it reports how many tokens it read and wrote, and it never falls over when a client sends
something strange.

Throughput is measured in tokens per second. Output tokens are the expensive ones, because every new
token needs a full pass over the weights. Input tokens are cheaper, since the prompt is processed in
large batches. Cached tokens are cheaper still: when two requests share a long system prompt, the
second one can reuse the keys and values of the first.

The weather in the north is cold and windy today, with light rain in the afternoon. In the south it
is warm and sunny, and the temperature will reach twenty five degrees. Tomorrow the wind will turn to
the west and the clouds will clear by the evening. People like to walk by the river when the sun is
out, and the small cafes along the water fill up quickly.

A library holds books, maps, letters and old newspapers. The reading room opens at nine in the
morning and closes at six in the evening. Visitors can ask the staff for help with a search, and the
catalogue lists every item by title, author, year and subject. Some of the oldest books may only be
read with gloves, under the watch of a librarian.

To bake bread you need flour, water, salt and yeast. Mix the dough, let it rest for an hour, fold it,
shape it, and bake it in a hot oven until the crust is brown and the loaf sounds hollow when you tap
the bottom. Good bread takes time, and most of that time is waiting.

Mathematics is the study of number, shape and pattern. Two plus two is four. Three times seven is
twenty one. The square root of sixteen is four, and the sum of the first ten numbers is fifty five.
A prime number has exactly two divisors: one and itself. The first primes are 2, 3, 5, 7, 11, 13,
17, 19, 23 and 29. Pi is about 3.14159 and e is about 2.71828.

Questions and answers:
Q: What is the capital of France? A: Paris.
Q: How many days are in a week? A: Seven.
Q: What colour is the sky on a clear day? A: Blue.
Q: Who wrote the letter? A: The letter was written by the mayor of the town.
Q: Can you help me plan a trip? A: Of course. Where would you like to go, and for how long?

<|im_start|>system
You are a helpful assistant. Answer briefly and clearly.<|im_end|>
<|im_start|>user
Hello! Can you tell me a short story about a robot?<|im_end|>
<|im_start|>assistant
<think>
The user wants a short story. I will keep it to a few sentences.
</think>

Once upon a time, a small robot lived in a quiet workshop. Every night it swept the floor and
counted the stars through the window. One night it found a lost kitten, and from then on it never
counted the stars alone.<|im_end|>
<|im_start|>user
What is the weather in Paris?<|im_end|>
<|im_start|>assistant
<think>

</think>

<tool_call>
<function=get_weather>
<parameter=city>
Paris
</parameter>
<parameter=unit>
celsius
</parameter>
</function>
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
{"city": "Paris", "temperature": 21, "unit": "celsius", "condition": "sunny"}
</tool_response><|im_end|>
<|im_start|>assistant
<think>

</think>

It is sunny in Paris right now, at 21 degrees Celsius.<|im_end|>

# Tools

You have access to the following functions:

<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The name of the city"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
{"type": "function", "function": {"name": "search_web", "description": "Search the web and return the top results", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 10}}, "required": ["query"]}}}
</tools>

{"id": "chatcmpl-123", "object": "chat.completion", "created": 1700000000, "model": "tiny",
 "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there!"},
 "finish_reason": "stop"}], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}}
{"name": "Ada", "age": 36, "languages": ["English", "French"], "active": true, "score": null}
{"items": [{"sku": "A-100", "price": 9.99, "quantity": 2}, {"sku": "B-200", "price": 14.5, "quantity": 1}]}

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def increment(self, step: int = 1) -> int:
        self.value += step
        return self.value


for index, item in enumerate(["alpha", "beta", "gamma", "delta"]):
    print(f"{index}: {item}")

import json
with open("data.json", "r", encoding="utf-8") as handle:
    data = json.load(handle)
if not data:
    raise ValueError("empty input")

SELECT name, count(*) FROM orders WHERE status = 'shipped' GROUP BY name ORDER BY 2 DESC LIMIT 10;

The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How vexingly
quick daft zebras jump! Sphinx of black quartz, judge my vow.

Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 20 25 30 42 50 64 99 100 128 256 512 1000 1024 2048 4096 8192
Dates: 2024-01-15, 2025-06-30, 1999-12-31. Times: 09:30, 12:00, 18:45. Prices: $5, $12.50, 3.75 EUR.

Thank you for your question. I am not sure, but I will try my best. Let me think step by step.
First, we read the problem. Second, we write down what we know. Third, we check the answer.
Yes. No. Maybe. Please. Sorry. Great, that works! Could you say that again? I do not understand.

Bonjour, comment allez-vous? Très bien, merci. Guten Tag, wie geht es Ihnen? Hola, ¿qué tal?
日本語のテキストも少し含めます。中文也有一点。한국어도 조금 있습니다. Ελληνικά. Русский текст.
Emoji: 🙂 🚀 ✅ — and some symbols: © ® ° ± × ÷ → ← ∑ √ ∞.
"""
