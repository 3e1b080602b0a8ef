"""`hybridserve run-batch -i in.jsonl -o out.jsonl [MODEL] [engine flags]`: a batch input file run offline.

The input has the Batch API's lines (`{custom_id, method, url, body}`, any of BATCH_MODELS' urls) and is
checked first, streamed, by the online validator: an invalid line stops the run before the model loads, each
reported with its line number (as an online batch fails validation). Then the engine starts in a worker
process (router.deploy.build_engine, as `serve` does, so the event loop renders and detokenizes while the engine
computes) and every line runs through the endpoints' services, the HTTP routes' own code, with at most
--max-requests-in-flight at a time; results go to one output file (batches/offline.py). `--resume` skips
the custom_ids the output already has. Stored Responses (`store: true`) go to a temporary database, removed
at the end.

Exit status: 0 once every line ran, failed requests included (they are lines with an error status); 1 for
invalid input, an output --resume cannot continue, or an engine that stopped; 2 for a usage error; 130 on
Ctrl-C and 143 on SIGTERM (results so far are kept: rerun with --resume).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridserve.config import DeploymentConfig, EngineConfig, ExtensionConfig, ServingConfig
from hybridserve.serving.app import default_parsers
from hybridserve.serving.extensions import extension_for
from hybridserve.serving.flags import add_log_level_flag, add_model_flags, model_configs
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.batches.execute import Progress
from hybridserve.serving.openai.batches.offline import (
    Done,
    EngineFailed,
    OfflineRun,
    OutputFileError,
    ResultFile,
    count_in_input,
    pending_lines,
    read_done,
)
from hybridserve.serving.openai.batches.runner import BatchSettings
from hybridserve.serving.openai.batches.validate import validate_input
from hybridserve.serving.openai.endpoints import BATCH_MODELS, GenerationServices
from hybridserve.serving.openai.responses.store import ResponseStore
from hybridserve.serving.storage import DATABASE_FILE, Database

if TYPE_CHECKING:
    from hybridserve.engine.async_llm import AsyncLLM

logger = logging.getLogger("hybridserve.run_batch")


def add_parser(commands: Any) -> None:
    """The `run-batch` subcommand on `commands` (the top parser's subparsers)."""
    defaults = BatchSettings()
    parser = commands.add_parser(
        "run-batch",
        help="run a batch input file offline, without HTTP, results to a file",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "-i",
        "--input-file",
        type=Path,
        required=True,
        help="JSONL batch input: one {custom_id, method: POST, url, body} a line; url one of "
        + ", ".join(BATCH_MODELS),
    )
    parser.add_argument(
        "-o",
        "--output-file",
        type=Path,
        required=True,
        help="JSONL results, one {id, custom_id, response: {status_code, request_id, body}, error} a line in the "
        "order requests finish, errors included (response.status_code >= 400); must not hold results unless "
        "--resume",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue --output-file: cut off a torn last line, then run only the custom_ids it does not have",
    )
    parser.add_argument(
        "--max-requests-in-flight",
        type=int,
        default=defaults.max_requests_in_flight,
        help="most requests handed to the engine at once",
    )
    parser.add_argument(
        "--worker-timeout",
        type=float,
        default=DeploymentConfig().worker_timeout,
        metavar="SECONDS",
        help="seconds without a heartbeat after which the engine worker counts as down and the run stops (raise "
        "it on a busy machine, where one large prefill step can take longer)",
    )
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=defaults.progress_interval_s,
        metavar="SECONDS",
        help="log a progress line (done/total, rate, ETA) this often",
    )
    add_model_flags(parser)
    add_log_level_flag(parser)
    parser.set_defaults(command_parser=parser)


def main(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args.command_parser
    config, serving, extension_config = model_configs(args, parser)
    _check_usage(args, parser)
    validation = validate_input(args.input_file, BATCH_MODELS, None, threading.Event())
    if validation.num_errors:
        lines = "\n".join(f"  {error['message']}" for error in validation.report())
        plural = "s" if validation.num_errors > 1 else ""
        print(
            f"hybridserve run-batch: error: {args.input_file} has {validation.num_errors} invalid line{plural}; "
            f"nothing was run:\n{lines}",
            file=sys.stderr,
        )
        return 1
    try:
        done = read_done(args.output_file)
    except OutputFileError as exc:
        print(f"hybridserve run-batch: error: {exc}; --resume cannot continue this file.", file=sys.stderr)
        return 1
    try:
        return _run(args, config, serving, extension_config, done, validation.total)
    finally:
        done.ids.close()


def _check_usage(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    source, output = args.input_file, args.output_file
    if not source.is_file():
        parser.error(f"--input-file: {source} is not a file")
    if output.resolve() == source.resolve():
        parser.error(f"--output-file: {output} is the input file")
    if not output.parent.is_dir():
        parser.error(f"--output-file: directory {output.parent} does not exist")
    if not args.resume and output.exists() and output.stat().st_size:
        parser.error(
            f"--output-file: {output} already holds results ({output.stat().st_size} bytes); pass --resume to run "
            "only the custom_ids it lacks, or remove it"
        )
    if args.max_requests_in_flight < 1:
        parser.error(f"--max-requests-in-flight: must be at least 1, got {args.max_requests_in_flight}")
    for flag in ("progress_interval", "worker_timeout"):
        if not 0 < (value := getattr(args, flag)) < float("inf"):
            parser.error(f"--{flag.replace('_', '-')}: must be positive, got {value}")


def _run(
    args: argparse.Namespace,
    config: EngineConfig,
    serving: ServingConfig,
    extension_config: ExtensionConfig,
    done: Done,
    total: int,
) -> int:
    if len(done.ids):
        present = count_in_input(args.input_file, done.ids)
        if present != len(done.ids):
            print(
                f"hybridserve run-batch: error: {args.output_file} holds {len(done.ids) - present} results whose "
                f"custom_id is not in {args.input_file}: is it the output of another input?",
                file=sys.stderr,
            )
            return 1
    if done.torn:
        logger.warning(
            "cutting a torn last line (%d bytes) off %s: the run that wrote it stopped mid-write",
            done.torn,
            args.output_file,
        )
    pending = total - len(done.ids)
    logger.info(
        "run-batch: %d requests in %s, %d already in %s, %d to run",
        total,
        args.input_file,
        len(done.ids),
        args.output_file,
        pending,
    )
    results = ResultFile(args.output_file, done.length)
    progress = done.progress()
    engine: AsyncLLM | None = None
    try:
        if pending:
            from hybridserve.router.deploy import build_engine  # heavy (torch): imported only to run

            engine = build_engine(config, DeploymentConfig(worker_timeout=args.worker_timeout), serving)
            asyncio.run(_execute(engine, extension_config, args, results, progress, done, total))
    except EngineFailed as exc:
        return _stopped(str(exc), 1, progress, total, args)
    except KeyboardInterrupt:
        return _stopped("interrupted", 130, progress, total, args)
    except asyncio.CancelledError:  # SIGTERM (see _execute)
        return _stopped("stopped by SIGTERM", 143, progress, total, args)
    finally:
        results.close()
        if engine is not None:
            engine.shutdown()
    elapsed = time.monotonic() - progress.started
    logger.info(
        "run-batch: all %d requests done (%d completed, %d failed), %d run in %.1f s; results in %s",
        total,
        progress.completed,
        progress.failed,
        progress.done - progress.done_at_start,
        elapsed,
        args.output_file,
    )
    return 0


def _stopped(why: str, status: int, progress: Progress, total: int, args: argparse.Namespace) -> int:
    logger.error(
        "run-batch: %s; %d/%d requests done, their results in %s. Rerun with --resume to finish.",
        why,
        progress.done,
        total,
        args.output_file,
    )
    return status


async def _execute(
    engine: AsyncLLM,
    extension_config: ExtensionConfig,
    args: argparse.Namespace,
    results: ResultFile,
    progress: Progress,
    done: Done,
    total: int,
) -> None:
    """The endpoints' services over `engine`, as `serve` builds them, running the input's pending lines."""
    task = asyncio.current_task()
    assert task is not None  # a coroutine run by asyncio.run is a task
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    extension = extension_for(engine.model_type, extension_config)
    parsers = default_parsers(engine.tokenizer, extension, args.reasoning_parser, args.tool_parser)
    logger.info("output parsers: reasoning %s, tools %s", parsers.reasoning, parsers.tool)
    metrics = ServingMetrics(engine.model_name, engine.stats)
    with tempfile.TemporaryDirectory(prefix="hybridserve-run-batch-") as store_dir:
        db = Database(Path(store_dir) / DATABASE_FILE)
        try:
            store, policy = ResponseStore(db), args.scheduling_policy
            services = GenerationServices.build(engine, metrics, store, parsers, extension, policy=policy)
            run = OfflineRun(
                engine,
                services.batch_endpoints(),
                results,
                progress,
                total,
                args.max_requests_in_flight,
                args.progress_interval,
            )
            await run.run(pending_lines(args.input_file, done.ids))
        finally:
            db.close()
