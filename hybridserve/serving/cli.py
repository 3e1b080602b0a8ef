"""The `hybridserve` command: `serve [MODEL]` (the HTTP frontend over its engine workers, one local worker by
default), `worker [MODEL]` (a standalone engine worker for frontends on other hosts) and `run-batch` (a batch
file through the same endpoints, offline: serving/run_batch.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn
import yaml

from hybridserve.config import DeploymentConfig, EngineConfig, parse_bytes
from hybridserve.process import freeze_startup_heap
from hybridserve.sampling_params import InvalidParameter
from hybridserve.serving import run_batch
from hybridserve.serving.flags import (
    add_config_flags,
    add_log_level_flag,
    add_model_flags,
    config_from,
    flag_type,
    model_configs,
)
from hybridserve.serving.openai.batches.runner import BatchSettings
from hybridserve.serving.openai.body import DEFAULT_MAX_BODY_BYTES
from hybridserve.serving.openai.responses.store import Retention

logger = logging.getLogger("hybridserve.serve")
WORKER_API_KEY_ENV = (
    "HYBRIDSERVE_WORKER_API_KEY"  # the workers' shared secret: serve's --worker-api-key, worker's --api-key
)


def default_data_dir() -> Path:
    """$HYBRIDSERVE_DATA_DIR, else ~/.local/share/hybridserve."""
    configured = os.environ.get("HYBRIDSERVE_DATA_DIR")
    return Path(configured) if configured else Path.home() / ".local" / "share" / "hybridserve"


def build_parser(serve_defaults: dict[str, Any] | None = None) -> argparse.ArgumentParser:
    """`serve_defaults` (a deployment file's values, by flag dest) replace serve's defaults; strings among them
    are parsed as the flag would parse them."""
    parser = argparse.ArgumentParser(prog="hybridserve", description="Serve LLMs behind the OpenAI API.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve one model over HTTP", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    serve.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="DEPLOY_YAML",
        help="a YAML deployment file whose keys are these flags' names (docs/deployment.md); flags given on "
        "the command line win over it",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key as 'Authorization: Bearer <key>' on /v1 routes; None: no key",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=flag_type(parse_bytes),
        default=DEFAULT_MAX_BODY_BYTES,
        help="largest JSON request body (bytes, or with a unit such as 16MiB); a larger one gets a 413 as soon as it "
        "passes the limit, or at once when its Content-Length says so (/v1/files uploads: --max-upload-bytes)",
    )
    serve.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        help="directory of the SQLite database (stored responses, files, batches) and of uploaded and batch files "
        "($HYBRIDSERVE_DATA_DIR overrides the default)",
    )
    serve.add_argument(
        "--response-store-max-count",
        type=int,
        default=Retention.max_count,
        help="keep at most this many stored responses, evicting the oldest (0: unlimited)",
    )
    serve.add_argument(
        "--response-store-max-age",
        type=int,
        default=Retention.max_age_s,
        metavar="SECONDS",
        help="evict stored responses older than this many seconds (default 30 days; 0: unlimited)",
    )
    add_batch_flags(serve)
    serve.add_argument(
        "--num-postprocess-workers",
        type=int,
        default=0,
        metavar="N",
        help="processes that detokenize, parse and build events for the Responses API off the HTTP event loop "
        "(0: on the event loop; background responses always run there)",
    )
    add_model_flags(serve)
    add_config_flags(serve, DeploymentConfig)
    add_log_level_flag(serve)
    serve.set_defaults(**(serve_defaults or {}))
    add_worker_parser(commands)
    run_batch.add_parser(commands)
    return parser


def add_worker_parser(commands: argparse._SubParsersAction) -> None:
    worker = commands.add_parser(
        "worker",
        help="run one engine worker for frontends on other hosts",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    worker.add_argument(
        "--listen",
        default="tcp://127.0.0.1:8100",
        help="address to serve frontends on (tcp://HOST:PORT); off loopback it needs --api-key",
    )
    worker.add_argument(
        "--api-key",
        default=None,
        help="shared secret frontends must send (their --worker-api-key); $HYBRIDSERVE_WORKER_API_KEY also sets it",
    )
    add_config_flags(worker, EngineConfig)
    add_log_level_flag(worker)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """Parses `argv`; with `serve --config FILE`, the file's keys become the flags' defaults first."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is None:
        return args, parser
    try:
        values = yaml.safe_load(args.config.read_text())
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {args.config}: {exc}")
    if not isinstance(values, dict):
        parser.error(f"--config {args.config}: expected a mapping of flag names to values, got {type(values).__name__}")
    known = set(vars(args)) - {"command", "config"}
    unknown = sorted(str(k) for k in values if str(k).replace("-", "_") not in known)
    if unknown:
        parser.error(f"--config {args.config}: unknown keys {unknown} (keys are serve's flag names)")
    parser = build_parser({str(k).replace("-", "_"): v for k, v in values.items()})
    return parser.parse_args(argv), parser


def add_batch_flags(serve: argparse.ArgumentParser) -> None:
    """The Files and Batch APIs' limits."""
    defaults = BatchSettings()
    serve.add_argument(
        "--max-upload-bytes",
        type=flag_type(parse_bytes),
        default=defaults.max_upload_bytes,
        help="largest file /v1/files accepts (bytes, or with a unit such as 512MiB); larger uploads get a 413",
    )
    serve.add_argument(
        "--batch-max-lines",
        type=int,
        default=defaults.max_lines,
        help="most requests in one batch input file; a larger file fails validation",
    )
    serve.add_argument(
        "--max-active-batches",
        type=int,
        default=defaults.max_active_batches,
        help="most batches validated or run at once; a batch created past it waits, queued (FIFO), for a slot",
    )
    serve.add_argument(
        "--max-queued-batches",
        type=int,
        default=defaults.max_queued_batches,
        help="most batches waiting for a slot (--max-active-batches); creating one more answers 429 (0: no queue)",
    )
    serve.add_argument(
        "--batch-max-requests-in-flight",
        type=int,
        default=defaults.max_requests_in_flight,
        help="most requests of one batch handed to the engine at once",
    )


def batch_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BatchSettings:
    flags = ("max_upload_bytes", "batch_max_lines", "max_active_batches", "batch_max_requests_in_flight")
    for flag in flags:
        if (value := getattr(args, flag)) < 1:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 1, got {value}")
    if args.max_queued_batches < 0:
        parser.error(f"--max-queued-batches: must be at least 0, got {args.max_queued_batches}")
    return BatchSettings(
        max_upload_bytes=args.max_upload_bytes,
        max_lines=args.batch_max_lines,
        max_active_batches=args.max_active_batches,
        max_queued_batches=args.max_queued_batches,
        max_requests_in_flight=args.batch_max_requests_in_flight,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from(EngineConfig, args)


def worker_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from hybridserve.engine.worker import check_listen_address, run_standalone_worker  # heavy (torch)
    from hybridserve.models.loader import resolve_model

    try:
        config = engine_config(args)
    except InvalidParameter as exc:
        parser.error(f"--{exc.param.replace('_', '-')}: {exc}")
    secret = args.api_key or os.environ.get(WORKER_API_KEY_ENV, "")
    try:
        check_listen_address(args.listen, secret)
        resolved = resolve_model(config.model.model)
    except ValueError as exc:
        parser.error(str(exc))
    run_standalone_worker(config, resolved.hf_dir, resolved.name, args.listen, secret)


class ReadyServer(uvicorn.Server):
    """Logs one ready line with the bound URL once the socket listens, and stops the engine's processes as
    part of its own shutdown: uvicorn re-raises the signal that stopped it afterwards, and SIGTERM's default
    action ends the process at once, before any `finally` of the caller could run."""

    def __init__(self, config: uvicorn.Config, model_name: str, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.on_shutdown = on_shutdown

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            logger.info("hybridserve ready: serving %s at http://%s:%d/v1", self.model_name, host, port)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets)
        self.on_shutdown()


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    config, serving, extension_config = model_configs(args, parser)
    try:
        deployment = config_from(DeploymentConfig, args)
    except InvalidParameter as exc:
        parser.error(f"--{exc.param.replace('_', '-')}: {exc}")
    if deployment.worker_api_key is None and os.environ.get(WORKER_API_KEY_ENV):
        deployment = dataclasses.replace(deployment, worker_api_key=os.environ[WORKER_API_KEY_ENV])
    if args.max_request_body_bytes < 1:
        parser.error(f"--max-request-body-bytes: must be at least 1, got {args.max_request_body_bytes}")
    if args.num_postprocess_workers < 0:
        parser.error(f"--num-postprocess-workers: must be at least 0, got {args.num_postprocess_workers}")
    for flag in ("response_store_max_count", "response_store_max_age"):
        if (value := getattr(args, flag)) < 0:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 0 (0 means unlimited), got {value}")
    retention = Retention(args.response_store_max_count, args.response_store_max_age)
    batches = batch_settings(args, parser)
    from hybridserve.router.deploy import build_engine  # heavy (torch): imported only to serve
    from hybridserve.serving.app import build_app, default_parsers
    from hybridserve.serving.extensions import extension_for
    from hybridserve.serving.postprocess import PostprocessPool
    from hybridserve.serving.storage import DataDir, DataDirInUse

    try:
        data_dir = DataDir(args.data_dir)  # before loading the model: a second server on it stops at once
    except DataDirInUse as exc:
        parser.exit(1, f"hybridserve serve: error: {exc}\n")
    fatal: list[str] = []  # why the engine cannot serve again, once it is known
    servers: list[ReadyServer] = []

    def give_up(reason: str) -> None:
        logger.critical("%s; exiting so that a supervisor can start the server again", reason)
        fatal.append(reason)
        for server in servers:
            server.should_exit = True

    engine = build_engine(config, deployment, serving, on_fatal=give_up)
    pool = None
    stopped = False

    def stop() -> None:
        """The worker processes and their socket directories, once: at server shutdown, or on an error."""
        nonlocal stopped
        if not stopped:
            stopped = True
            if pool is not None:
                pool.shutdown()
            engine.shutdown()
            data_dir.close()

    try:
        extension = extension_for(engine.model_type, extension_config)
        parsers = default_parsers(engine.tokenizer, extension, args.reasoning_parser, args.tool_parser)
        logger.info("output parsers: reasoning %s, tools %s", parsers.reasoning, parsers.tool)
        if args.num_postprocess_workers:
            pool = PostprocessPool(engine.hf_dir, args.num_postprocess_workers)
        app = build_app(
            engine,
            args.api_key,
            data_dir,
            retention,
            parsers,
            pool,
            extension,
            batch_settings=batches,
            max_body_bytes=args.max_request_body_bytes,
            scheduling_policy=serving.scheduling_policy,
        )
        server_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
        servers.append(ReadyServer(server_config, engine.model_name, stop))
        freeze_startup_heap("frontend")
        servers[0].run()
    finally:
        stop()
    if fatal:
        raise SystemExit(f"hybridserve serve: {fatal[0]}")


def main(argv: list[str] | None = None) -> int | None:
    args, parser = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "run-batch":
        return run_batch.main(args)
    if args.command == "worker":
        worker_command(args, parser)
        return None
    try:
        serve(args, parser)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after a clean shutdown
        return 130
    return None


if __name__ == "__main__":
    sys.exit(main())
