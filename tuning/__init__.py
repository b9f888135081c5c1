"""Benchmarks, sweeps and the MoE tuner (command lines); measured results under tuning/results/, the notes in
tuning/notes_*.md. The tuned configs ship with the kernels (kernels_triton/configs/)."""
