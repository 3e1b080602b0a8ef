"""Command-line flags both commands share (`serve`, `run-batch`): one flag per config dataclass field, the
output parsers, the log level; and the configs built back from them, a bad value being a usage error."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable
from typing import Any, TypeVar

from hybridserve.config import EngineConfig, ExtensionConfig, ServingConfig, env_bool
from hybridserve.sampling_params import InvalidParameter
from hybridserve.serving.parsers.reasoning import REASONING_PARSERS
from hybridserve.serving.parsers.tools import TOOL_PARSERS

C = TypeVar("C")


def add_config_flags(parser: argparse.ArgumentParser, config: type) -> None:
    """One argument per field of the dataclass `config`: `--field-name` (the bare name if its metadata says
    positional, its `flag` if it names one), the field's default and help, and the options its metadata holds;
    a bool is --x / --no-x, a list a repeatable flag."""
    hints = typing.get_type_hints(config)
    for f in dataclasses.fields(config):
        if f.metadata.get("part"):  # one of EngineConfig's parts: its fields are flags of their own
            add_config_flags(parser, hints[f.name])
            continue
        options = dict(f.metadata)
        options.pop("bounds", None)  # checked by the config itself, naming the field
        if "help" in options:  # plain text: a % in it is a percent sign, not one of argparse's format fields
            options["help"] = options["help"].replace("%", "%%")
        positional = options.pop("positional", False)
        flag = options.pop("flag", "--" + f.name.replace("_", "-"))
        kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
        default = f.default
        if typing.get_origin(kind) is list:  # a repeatable flag
            options["action"] = "append"
            (kind,) = typing.get_args(kind)
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
            if "env" in options:
                default = bool_from_env(parser, options.pop("env"), default)
        elif "type" in options:
            options["type"] = flag_type(options["type"])
        elif kind is not str:
            options["type"] = kind
        if positional:
            parser.add_argument(f.name, nargs="?", default=default, **options)
        else:
            parser.add_argument(flag, dest=f.name, default=default, **options)


def bool_from_env(parser: argparse.ArgumentParser, variable: str, default: bool) -> bool:
    """$variable as a flag's default (config.env_bool); a value other than 1 or 0 is a usage error."""
    try:
        return env_bool(variable, default)
    except ValueError as exc:
        parser.error(str(exc))


def flag_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type: the ValueError it raises becomes the usage error's message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def config_from(config: type[C], args: argparse.Namespace) -> C:
    """The dataclass `config` (its parts too) built from the arguments add_config_flags made for it."""
    hints = typing.get_type_hints(config)
    return config(
        **{
            f.name: config_from(hints[f.name], args) if f.metadata.get("part") else getattr(args, f.name)
            for f in dataclasses.fields(config)
        }
    )


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's flags (EngineConfig's parts, the MODEL positional among them), the frontend's model settings
    (ServingConfig), the extensions' and the output parsers': what decides the answers a request gets."""
    parser.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=["auto", "none", *REASONING_PARSERS],
        help="how reasoning is read out of the output (auto: from the chat template; none: all of it is text)",
    )
    parser.add_argument(
        "--tool-parser",
        default="auto",
        choices=["auto", "none", *TOOL_PARSERS],
        help="how tool calls are read out of the output (auto: from the chat template, hermes for templates "
        "without tools, which get tools in the Hermes form; none: calls stay text)",
    )
    add_config_flags(parser, EngineConfig)
    add_config_flags(parser, ServingConfig)
    add_config_flags(parser, ExtensionConfig)


def add_log_level_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="logging level for hybridserve (and for uvicorn, under serve)",
    )


def model_configs(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[EngineConfig, ServingConfig, ExtensionConfig]:
    """The configs add_model_flags made flags for; a value they reject is a usage error naming its flag."""
    try:
        return config_from(EngineConfig, args), config_from(ServingConfig, args), config_from(ExtensionConfig, args)
    except InvalidParameter as exc:
        parser.error(f"--{exc.param.replace('_', '-')}: {exc}")
