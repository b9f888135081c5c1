"""Which of vLLM's routes need the API key, run our request checks, or are switched off.

`qwen35-serve` denies by default: every route of the running app is classified by its path
template, and a route not in the table (one a later vLLM adds) needs the key like any other, and is
named in a start-up WARNING until it is classified here.

- `OPEN`: answers without the key (health and version probes);
- `METRICS`: `/metrics`, open unless the config sets `public_metrics: false`;
- `ENGINE`: runs the model; needs the key and passes our request checks (`serve.checks`);
- `KEYED`: needs the key (listings, tokenizer, docs, render-only and read-only routes);
- `ADMIN`: changes the server's state (scaling, sleep/wake, cache resets, collective RPC, LoRA
  loading, profiling, weight updates, request aborts); off (404) unless `admin_routes: true`, and
  then behind the key;
- `OFF`: routes that reach the engine but that our checks do not cover (pooling, scoring by
  embeddings, speech): always 404;
- `UNCLASSIFIED`: a route missing from `ROUTES`; treated as `KEYED`.

Matching uses Starlette's own route matching against the app's routes, so a path with parameters
(`/v1/responses/{response_id}`) maps to its template, and a method the route does not take still
maps to it (vLLM answers 405). This module imports Starlette only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger("vllm.qwen35.serve")

OPEN, METRICS, ENGINE, KEYED, ADMIN, OFF, UNCLASSIFIED = (
    "open", "metrics", "engine", "keyed", "admin", "off", "unclassified")  # fmt: skip


def _table(kind: str, paths: str) -> dict[str, str]:
    return {path: kind for path in paths.split()}


ROUTES: dict[str, str] = {
    **_table(OPEN, "/health /ping /version"),
    **_table(METRICS, "/metrics"),
    **_table(ENGINE, "/v1/chat/completions /v1/completions /invocations /v1/chat/completions/batch /v1/responses "
             "/v1/messages /inference/v1/generate /generative_scoring /v1/systemone"),
    **_table(KEYED, "/v1/models /tokenize /detokenize /load /kv_event_sources /openapi.json /docs "
             "/docs/oauth2-redirect /redoc /static /v1/responses/{response_id} /v1/responses/{response_id}/cancel "
             "/v1/messages/count_tokens /v1/chat/completions/render /v1/messages/render /v1/completions/render "
             "/v1/responses/render /v1/chat/completions/derender /v1/completions/derender "
             "/inference/v1/abort_requests /server_info /is_sleeping /is_paused /is_scaling_elastic_ep "
             "/fault_tolerance/status /weight_info /get_world_size"),
    **_table(ADMIN, "/scale_elastic_ep /v1/load_lora_adapter /v1/unload_lora_adapter /adapters "
             "/adapters/{adapter_name} /start_profile /stop_profile /reset_prefix_cache /reset_mm_cache "
             "/reset_encoder_cache /collective_rpc /sleep /wake_up /release_kv_cache_memory /pause /resume "
             "/abort_requests /init_weight_transfer_engine /shutdown_weight_transfer_engine /start_weight_update "
             "/start_draft_weight_update /update_weights /finish_weight_update /update_weight_version "
             "/weight_checker /fault_tolerance/apply"),
    **_table(OFF, "/v1/embeddings /pooling /classify /score /v1/score /rerank /v1/rerank /v2/rerank /v2/embed "
             "/v1/audio/transcriptions /v1/audio/translations /v1/realtime"),
}  # fmt: skip


def kind_of(template: str | None) -> str:
    """The class of a route template (None: no route matched, which is treated like a keyed route)."""
    if template is None:
        return KEYED
    return ROUTES.get(template, UNCLASSIFIED)


@dataclass(frozen=True)
class RouteInfo:
    """One route of the app, as the route table lists it."""

    path: str
    methods: tuple[str, ...]
    kind: str


def app_routes(app: object) -> list[RouteInfo]:
    """Every route of a Starlette/FastAPI app with its class (mounts have no methods)."""
    infos = []
    for route in getattr(app, "routes", None) or []:
        path = getattr(route, "path", None)
        if path is None:
            continue
        methods = tuple(sorted(getattr(route, "methods", None) or ()))
        infos.append(RouteInfo(path, methods, kind_of(path)))
    return infos


def match(app: object, scope: dict) -> tuple[object | None, str | None]:
    """(route, path template) of the first route of `app` that matches the request's path, whatever
    its method; (None, None) when none does."""
    from starlette.routing import Match

    partial = None
    for route in getattr(app, "routes", None) or []:
        try:
            found, _ = route.matches(scope)
        except Exception:  # a route type that cannot match this scope
            continue
        if found == Match.FULL:
            return route, getattr(route, "path", None)
        if found == Match.PARTIAL and partial is None:
            partial = route
    return (partial, getattr(partial, "path", None)) if partial is not None else (None, None)


TABLE_LOG = "qwen35-serve routes: "


def describe(routes: Iterable[RouteInfo]) -> dict[str, list[str]]:
    """Routes by class, each as 'METHODS path' ('*' for a mount, which takes any method)."""
    by_kind: dict[str, list[str]] = {}
    for info in routes:
        entry = f"{','.join(info.methods) or '*'} {info.path}"
        if entry not in by_kind.setdefault(info.kind, []):
            by_kind[info.kind].append(entry)
    return by_kind


def log_table(routes: Iterable[RouteInfo], keyed: bool, admin_routes: bool, public_metrics: bool) -> None:
    """One INFO line with the route table as JSON (key state, then routes by class), one WARNING per
    unclassified route."""
    routes = list(routes)
    table = {"api_key": "required" if keyed else "not configured", "admin_routes": "on" if admin_routes else "off",
             "public_metrics": public_metrics, **describe(routes)}  # fmt: skip
    log.info("%s%s", TABLE_LOG, json.dumps(table))
    for info in routes:
        if info.kind == UNCLASSIFIED:
            log.warning("qwen35-serve: route %s is not in serve.routes.ROUTES: it needs the API key but gets no "
                        "request checks; classify it", info.path)  # fmt: skip
