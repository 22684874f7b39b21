"""What routers and fleet tools read from a replica, in SGLang's shapes (the SGLang Model Gateway, sglang-router,
fronts any worker that answers these):

    GET  /health_generate              200 once a one-token generation completes (503 warming up, or past 20 s)
    GET  /server_info, /get_server_info   the server's settings and state (max_running_requests, max_total_tokens,
                                       context_length, page_size, the speculative method, avg_spec_accept_length)
    GET  /model_info, /get_model_info  model_path, served_model_name, model_type, architectures, is_generation
    GET  /get_load                     [{dp_rank, num_reqs, num_waiting_reqs, num_tokens}]
    POST /flush_cache (GET too)        forgets the prefix cache while no request runs (400 while one does)
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import threading
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from jspec.serve.protocol import APIError
from jspec.serve.requests import NotAccepting, QueueFull, Request
from jspec.serve.slots import SlotEngine

HEALTH_GENERATE_SECONDS = 20.0  # a one-token generation slower than this on a warm server means it is stuck


def _version() -> str:
    try:
        return importlib.metadata.version("jspec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _architectures(model_path: str | None) -> list[str]:
    path = None if model_path is None else os.path.join(model_path, "config.json")
    if path is None or not os.path.isfile(path):
        return []
    with open(path) as f:
        return list(json.load(f).get("architectures") or [])


def model_info(slots: SlotEngine, served_model_name: str, model_path: str | None) -> dict[str, Any]:
    """SGLang's /get_model_info for this replica."""
    return {"model_path": model_path, "tokenizer_path": model_path, "served_model_name": served_model_name,
            "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": slots.engine.config.model_type, "architectures": _architectures(model_path)}


def server_info(slots: SlotEngine, served_model_name: str, model_path: str | None) -> dict[str, Any]:
    """SGLang's /get_server_info: its server arguments' names for jspec's settings, and the running state."""
    setup, metrics = slots.setup, slots.metrics
    spec, drafter = setup.spec, setup.drafter
    steps = metrics.spec_drafts._value.get()
    accept = 1.0 + metrics.spec_accepted_tokens._value.get() / steps if steps else None
    mesh = setup.mesh
    return {
        "model_path": model_path, "tokenizer_path": model_path, "served_model_name": served_model_name,
        "context_length": slots.max_seq_len, "max_running_requests": slots.max_num_seqs,
        "max_total_tokens": slots.max_total_tokens, "chunked_prefill_size": slots.max_num_batched_tokens,
        "max_prefill_tokens": slots.max_num_batched_tokens, "page_size": slots.block_size,
        "disable_radix_cache": not slots.prefix_caching, "max_queued_requests": slots.max_queue,
        "tp_size": 1 if mesh is None else int(mesh.shape.get("model", 1)),
        "dp_size": 1 if mesh is None else int(mesh.shape.get("data", 1)),
        "speculative_algorithm": None if drafter is None else type(drafter).__name__.removesuffix("Drafter").upper(),
        "speculative_num_steps": None if spec is None else spec.max_depth,
        "speculative_eagle_topk": None if spec is None or spec.tree == "chain" else spec.topk,
        "speculative_num_draft_tokens": None if spec is None else spec.tree_size,
        "version": _version(),
        "internal_states": [{"avg_spec_accept_length": accept, "num_running_reqs": slots.num_running,
                             "num_waiting_reqs": slots.num_waiting}],
    }


def add_fleet_routes(app: FastAPI, slots: SlotEngine, served_model_name: str, model_path: str | None) -> None:
    """Adds the routes of the module docstring to ``app``."""

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not slots.ready:
            raise APIError("warming up", status=503, type="service_unavailable", retry_after=1)
        finished = threading.Event()
        bos = slots.engine.config.bos_token_id
        request = Request(prompt_ids=[0 if bos is None else int(bos)], max_tokens=1,
                          sink=lambda tokens, reason, *rest: finished.set() if reason is not None else None)
        try:
            slots.submit(request)
        except (QueueFull, NotAccepting) as error:
            raise APIError(str(error), status=503, type="service_unavailable", retry_after=1) from None
        if not await asyncio.to_thread(finished.wait, HEALTH_GENERATE_SECONDS):
            request.cancel()
            raise APIError(f"a one-token generation took over {HEALTH_GENERATE_SECONDS:.0f} s", status=503,
                           type="service_unavailable")
        return Response(status_code=200)

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, lambda: server_info(slots, served_model_name, model_path), methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, lambda: model_info(slots, served_model_name, model_path), methods=["GET"])
    app.add_api_route("/get_load", lambda: [slots.load()], methods=["GET"])

    async def flush_cache() -> Response:
        if not slots.flush_prefix_cache():
            return JSONResponse({"error": "requests are running or waiting: the cache was not flushed"},
                                status_code=400)
        return Response("Cache flushed.", status_code=200)

    app.add_api_route("/flush_cache", flush_cache, methods=["POST", "GET"])
