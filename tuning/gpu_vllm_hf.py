"""HF fp32 reference log-probs for :mod:`tuning.gpu_vllm`, in its own process (its GPU memory ends with it).

    python -m tuning.gpu_vllm_hf JOB.json OUT.json      # JOB: {"ckpt": path, "prompts": [[ids], ...]}
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m tuning.gpu_vllm_hf JOB.json OUT.json", file=sys.stderr)
        return 2
    from tuning.vllm_ckpt import hf_logprobs

    job = json.loads(open(argv[0]).read())
    t = time.perf_counter()
    logprobs = hf_logprobs(job["ckpt"], job["prompts"], device=job.get("device", "cuda"))
    with open(argv[1], "w") as f:
        json.dump({"logprobs": logprobs, "seconds": round(time.perf_counter() - t, 1)}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
