"""`qwen35-accept`: OpenAI-API conformance checks for any chat endpoint.

Run `python -m serve.accept --base-url http://127.0.0.1:8000/v1 [--api-key K]`; see `runner.run_suite`
for the library entry point and `suite` for how checks are written.
"""
