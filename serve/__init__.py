"""Serving kit: OpenAI server launcher, request-compat middleware, conformance and replay CLIs."""
