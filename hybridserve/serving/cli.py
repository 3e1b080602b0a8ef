"""`hybridserve serve [MODEL]`: one HTTP frontend plus one local engine process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
from pathlib import Path

import uvicorn

from hybridserve.config import DTYPES, EngineConfig
from hybridserve.sampling_params import InvalidParameter
from hybridserve.serving.openai.batches.runner import BatchSettings
from hybridserve.serving.openai.responses.store import Retention
from hybridserve.serving.parsers.reasoning import REASONING_PARSERS
from hybridserve.serving.parsers.tools import TOOL_PARSERS

logger = logging.getLogger("hybridserve.serve")

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """'2GiB' / '512MiB' / '1.5G' / '2GB' (decimal) / '1073741824' → bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB, 512MiB or 1073741824, got {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


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
    serve.add_argument(
        "model",
        nargs="?",
        default=None,
        help="GGUF file or Hugging Face directory; None: the embedded SmolLM2-135M",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind")
    serve.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key as 'Authorization: Bearer <key>' on /v1 routes; None: no key",
    )
    serve.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send and see; None: smollm2, or the model path's stem",
    )
    serve.add_argument(
        "--dtype",
        choices=DTYPES,
        default=_DEFAULTS["dtype"],
        help="weight, activation and KV-cache dtype "
        "(auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls, else float32)",
    )
    serve.add_argument("--device", default=_DEFAULTS["device"], help="cuda, cpu, or auto")
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=_DEFAULTS["max_model_len"],
        help="context length limit (prompt + completion); None: the model's",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=int,
        default=_DEFAULTS["max_num_seqs"],
        help="most sequences in one engine step",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_DEFAULTS["max_num_batched_tokens"],
        help="token budget of one engine step (default: 512 on CPU, 2048 on CUDA)",
    )
    serve.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=_DEFAULTS["long_prefill_token_threshold"],
        help="if >0, a prefill chunk takes at most this many tokens per step",
    )
    serve.add_argument(
        "--native-kernels",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS["native_kernels"],
        help="on CPU, run decode attention and fused element-wise ops as C kernels built at start-up with the "
        "system C compiler ($CC, default cc); PyTorch ops if they cannot be built, and always on CUDA",
    )
    serve.add_argument("--block-size", type=int, default=_DEFAULTS["block_size"], help="tokens per KV-cache block")
    serve.add_argument(
        "--kv-cache-memory-bytes",
        type=parse_bytes,
        default=_DEFAULTS["kv_cache_memory_bytes"],
        help="memory for the KV cache: bytes, or with a unit such as 2GiB or 512MiB",
    )
    serve.add_argument(
        "--num-kv-blocks",
        type=int,
        default=_DEFAULTS["num_kv_blocks"],
        help="number of KV-cache blocks (overrides --kv-cache-memory-bytes)",
    )
    serve.add_argument(
        "--num-state-slots",
        type=int,
        default=_DEFAULTS["num_state_slots"],
        help="models with linear attention: recurrent-state slots, one per running request (default: max-num-seqs)",
    )
    serve.add_argument(
        "--num-state-snapshots",
        type=int,
        default=_DEFAULTS["num_state_snapshots"],
        help="models with linear attention: recurrent-state snapshots kept for prefix-cache hits, evicted least "
        "recently used (default: as many as state slots; 0 turns prefix hits off for these models)",
    )
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=_DEFAULTS["enable_prefix_caching"],
        help="reuse KV blocks of earlier prompts with the same prefix",
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
    serve.add_argument("--seed", type=int, default=_DEFAULTS["seed"], help="engine random seed")
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
        type=parse_bytes,
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
    return EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_kv_blocks=args.num_kv_blocks,
        num_state_slots=args.num_state_slots,
        num_state_snapshots=args.num_state_snapshots,
        enable_prefix_caching=args.enable_prefix_caching,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        native_kernels=args.native_kernels,
        seed=args.seed,
    )


class ReadyServer(uvicorn.Server):
    """Logs one ready line with the bound URL once the socket listens."""

    def __init__(self, config: uvicorn.Config, model_name: str) -> None:
        super().__init__(config)
        self.model_name = model_name

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            logger.info("hybridserve ready: serving %s at http://%s:%d/v1", self.model_name, host, port)


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    try:
        config = engine_config(args)
    except InvalidParameter as exc:
        parser.error(f"--{exc.param.replace('_', '-')}: {exc}")
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
    try:
        extension = extension_for(engine.model_type)
        parsers = default_parsers(engine.tokenizer, extension, args.reasoning_parser, args.tool_parser)
        logger.info("output parsers: reasoning %s, tools %s", parsers.reasoning, parsers.tool)
        if args.num_postprocess_workers:
            pool = PostprocessPool(engine.hf_dir, args.num_postprocess_workers)
        app = build_app(
            engine, args.api_key, args.data_dir, retention, parsers, pool, extension, batch_settings=batches
        )
        server_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
        ReadyServer(server_config, engine.model_name).run()
    finally:
        if pool is not None:
            pool.shutdown()
        engine.shutdown()


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
