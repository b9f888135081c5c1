"""Autotune and benchmark CLIs; per-device tuned configs under tuning/configs/, results under tuning/results/."""
