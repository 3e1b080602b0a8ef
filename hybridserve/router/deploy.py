"""The engine a frontend serves with: its local workers and remote ones behind a router, under one AsyncLLM.

`hybridserve serve MODEL` is one local worker; `--num-workers N` starts N; `--worker URL` adds remote
workers. It is always the same router and the same path, only the worker list differs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hybridserve.config import DeploymentConfig, EngineConfig, ServingConfig
from hybridserve.engine.async_llm import GENERATION_CONFIG, AsyncLLM, eos_token_ids, sampling_defaults
from hybridserve.engine.identity import tokenizer_fingerprint, weights_fingerprint
from hybridserve.models.loader import resolve_model
from hybridserve.router.link import WorkerLink
from hybridserve.router.local import LocalWorkers
from hybridserve.router.policy import Routing
from hybridserve.router.router import ExpectedModel, Router, RouterSettings
from hybridserve.tokenizer import load_tokenizer

logger = logging.getLogger("hybridserve.engine")

STARTUP_TIMEOUT_S = 600.0  # loading a model; remote workers: until the first one answers


def build_engine(
    config: EngineConfig,
    deployment: DeploymentConfig | None = None,
    serving: ServingConfig | None = None,
    on_fatal: Callable[[str], None] | None = None,
) -> AsyncLLM:
    """Starts the local workers, waits until they (and at least one worker in all) answer, and returns the
    frontend's engine. Raises EngineUnavailable when none can serve, after stopping what it started. `on_fatal`
    hears (in the event loop) that the deployment cannot serve again: local workers keep failing to start."""
    deployment, serving = deployment or DeploymentConfig(), serving or ServingConfig()
    resolved = resolve_model(config.model.model)
    tokenizer = load_tokenizer(resolved.hf_dir)
    hf_dir = resolved.hf_dir
    defaults = sampling_defaults(hf_dir, serving.generation_config)
    if defaults.changed():
        logger.info(
            "requests that leave them out sample with %s's %s (--generation-config none: OpenAI's defaults)",
            GENERATION_CONFIG,
            ", ".join(f"{name}={value}" for name, value in defaults.changed().items()),
        )
    expected = ExpectedModel(resolved.name, weights_fingerprint(hf_dir), tokenizer_fingerprint(hf_dir))
    settings = RouterSettings(
        routing=Routing(deployment.routing_policy),
        temperature=deployment.routing_temperature,
        worker_timeout_s=deployment.worker_timeout,
        worker_step_timeout_s=deployment.worker_step_timeout,
        secret=deployment.worker_api_key or "",
        seed=config.model.seed,
        prefix_weight=deployment.routing_prefix_weight,
        max_local_prefill_tokens=deployment.max_local_prefill_tokens,
    )
    roles = ["both"] * deployment.local_workers
    roles += ["prefill"] * deployment.num_prefill_workers + ["decode"] * deployment.num_decode_workers
    local = LocalWorkers(config, hf_dir, resolved.name, roles) if roles else None
    links = [
        *(local.links if local else []),
        *(WorkerLink(url, url) for url in deployment.workers or ()),
        *(WorkerLink(url, url, "prefill") for url in deployment.prefill_workers or ()),
        *(WorkerLink(url, url, "decode") for url in deployment.decode_workers or ()),
    ]
    router = Router(
        links, expected, settings, local.start if local else None, local.shutdown if local else None, on_fatal
    )
    try:
        remote = deployment.workers or deployment.prefill_workers or deployment.decode_workers
        router.wait_for_workers(STARTUP_TIMEOUT_S, require_all=not remote)
    except BaseException:
        router.shutdown()
        raise
    name = serving.served_model_name or resolved.name
    return AsyncLLM(router, tokenizer, name, eos_token_ids(hf_dir, tokenizer), hf_dir, defaults)
