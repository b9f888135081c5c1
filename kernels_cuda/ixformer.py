"""``ixformer`` backend: adapter over Iluvatar CoreX's ixformer op library.

Ops are adapted only where ixformer has a matching function (see the probe's list); none is
adapted yet, so the probe passes over this backend with the reason below.
"""

from __future__ import annotations


def availability(caps) -> str | None:  # noqa: ANN001 - qwen35.probe.DeviceCaps
    if caps.vendor != "iluvatar":
        return "ixformer is Iluvatar CoreX only"
    if caps.ixformer_version is None:
        return "ixformer does not import"
    return None
