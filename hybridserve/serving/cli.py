"""`hybridserve serve [MODEL]`: one HTTP frontend plus one local engine process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import uvicorn

from hybridserve.config import EngineConfig, ExtensionConfig, parse_bytes
from hybridserve.sampling_params import InvalidParameter
from hybridserve.serving.openai.batches.runner import BatchSettings
from hybridserve.serving.openai.body import DEFAULT_MAX_BODY_BYTES
from hybridserve.serving.openai.responses.store import Retention
from hybridserve.serving.parsers.reasoning import REASONING_PARSERS
from hybridserve.serving.parsers.tools import TOOL_PARSERS

logger = logging.getLogger("hybridserve.serve")
C = TypeVar("C")


def add_config_flags(parser: argparse.ArgumentParser, config: type) -> None:
    """One argument per field of the dataclass `config`: `--field-name` (the bare name if its metadata says
    positional), the field's default and help, and the options its metadata holds; a bool is --x / --no-x."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        options = dict(f.metadata)
        positional = options.pop("positional", False)
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        default = f.default
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
            if "env" in options:
                default = _bool_from_env(parser, options.pop("env"), default)
        elif "type" in options:
            options["type"] = _flag_type(options["type"])
        elif kind is not str:
            options["type"] = kind
        if positional:
            parser.add_argument(f.name, nargs="?", default=default, **options)
        else:
            parser.add_argument("--" + f.name.replace("_", "-"), default=default, **options)


def _bool_from_env(parser: argparse.ArgumentParser, variable: str, default: bool) -> bool:
    """$variable as a flag's default: 1 or 0; unset or empty keeps `default`; anything else is a usage error."""
    value = os.environ.get(variable, "")
    if value not in ("", "0", "1"):
        parser.error(f"${variable} must be 1 or 0, got {value!r}")
    return default if value == "" else value == "1"


def _flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type: the ValueError it raises becomes the usage error's message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def config_from(config: type[C], args: argparse.Namespace) -> C:
    """The dataclass `config` built from the arguments add_config_flags made for it."""
    return config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(config)})


def default_data_dir() -> Path:
    """$HYBRIDSERVE_DATA_DIR, else ~/.local/share/hybridserve."""
    configured = os.environ.get("HYBRIDSERVE_DATA_DIR")
    return Path(configured) if configured else Path.home() / ".local" / "share" / "hybridserve"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridserve", description="Serve LLMs behind the OpenAI API.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve one model over HTTP", formatter_class=argparse.ArgumentDefaultsHelpFormatter
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
        type=_flag_type(parse_bytes),
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
        "--reasoning-parser",
        default="auto",
        choices=["auto", "none", *REASONING_PARSERS],
        help="how reasoning is read out of the output (auto: from the chat template; none: all of it is text)",
    )
    serve.add_argument(
        "--tool-parser",
        default="auto",
        choices=["auto", "none", *TOOL_PARSERS],
        help="how tool calls are read out of the output (auto: from the chat template, hermes for templates "
        "without tools, which get tools in the Hermes form; none: calls stay text)",
    )
    serve.add_argument(
        "--num-postprocess-workers",
        type=int,
        default=0,
        metavar="N",
        help="processes that detokenize, parse and build events for the Responses API off the HTTP event loop "
        "(0: on the event loop; background responses always run there)",
    )
    add_config_flags(serve, EngineConfig)
    add_config_flags(serve, ExtensionConfig)
    serve.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging level for hybridserve and uvicorn",
    )
    return parser


def add_batch_flags(serve: argparse.ArgumentParser) -> None:
    """The Files and Batch APIs' limits."""
    defaults = BatchSettings()
    serve.add_argument(
        "--max-upload-bytes",
        type=_flag_type(parse_bytes),
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
        help="most unfinished batches at once; creating one more answers 429",
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
    return BatchSettings(
        max_upload_bytes=args.max_upload_bytes,
        max_lines=args.batch_max_lines,
        max_active_batches=args.max_active_batches,
        max_requests_in_flight=args.batch_max_requests_in_flight,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return config_from(EngineConfig, args)


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
    try:
        config = engine_config(args)
        extension_config = config_from(ExtensionConfig, args)
    except InvalidParameter as exc:
        parser.error(f"--{exc.param.replace('_', '-')}: {exc}")
    if args.max_request_body_bytes < 1:
        parser.error(f"--max-request-body-bytes: must be at least 1, got {args.max_request_body_bytes}")
    if args.num_postprocess_workers < 0:
        parser.error(f"--num-postprocess-workers: must be at least 0, got {args.num_postprocess_workers}")
    for flag in ("response_store_max_count", "response_store_max_age"):
        if (value := getattr(args, flag)) < 0:
            parser.error(f"--{flag.replace('_', '-')}: must be at least 0 (0 means unlimited), got {value}")
    retention = Retention(args.response_store_max_count, args.response_store_max_age)
    batches = batch_settings(args, parser)
    from hybridserve.engine.async_llm import AsyncLLM  # heavy (torch): imported only to serve
    from hybridserve.serving.app import build_app, default_parsers
    from hybridserve.serving.extensions import extension_for
    from hybridserve.serving.postprocess import PostprocessPool

    engine = AsyncLLM.from_config(config)
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

    try:
        extension = extension_for(engine.model_type, extension_config)
        parsers = default_parsers(engine.tokenizer, extension, args.reasoning_parser, args.tool_parser)
        logger.info("output parsers: reasoning %s, tools %s", parsers.reasoning, parsers.tool)
        if args.num_postprocess_workers:
            pool = PostprocessPool(engine.hf_dir, args.num_postprocess_workers)
        app = build_app(
            engine,
            args.api_key,
            args.data_dir,
            retention,
            parsers,
            pool,
            extension,
            batch_settings=batches,
            max_body_bytes=args.max_request_body_bytes,
        )
        server_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
        ReadyServer(server_config, engine.model_name, stop).run()
    finally:
        stop()


def main(argv: list[str] | None = None) -> int | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        try:
            serve(args, parser)
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after a clean shutdown
            return 130


if __name__ == "__main__":
    sys.exit(main())
