"""The command line as the docs show it: `--help` of the top command and of every subcommand prints and exits 0,
and every `hybridserve ...` (or `make serve ARGS=...`) line of README.md and docs/*.md parses and builds its
configs, without running, so a documented command the parser refuses fails here rather than for a reader."""

from __future__ import annotations

import argparse
import itertools
import re
import shlex
from pathlib import Path

import pytest

from hybridserve.config import DeploymentConfig
from hybridserve.sampling_params import InvalidParameter
from hybridserve.serving import cli
from hybridserve.serving.flags import config_from, model_configs

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"(?:^|[\s/])hybridserve\s+(?:serve|worker|run-batch)\b|^make serve\b")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    actions = cli.build_parser()._subparsers._group_actions  # type: ignore[union-attr]
    return dict(actions[0].choices)


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, argv for cli.build_parser) for each command line in the docs: fenced code lines and inline code spans
    that run hybridserve (an inline `hybridserve serve` alone names the command). Usage notation is expanded: an
    optional `[...]` part is left out, `a|b` gives one command line per choice; leading VAR=value assignments and
    `# comments` are dropped."""
    found = []
    for path in DOCS:
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            for text in [line] if fenced else re.findall(r"`([^`]+)`", line):
                if not COMMAND.search(text.strip()) or re.fullmatch(r"hybridserve [a-z-]+", text.strip()):
                    continue  # not a command, or only a command's name in the prose
                where = f"{path.relative_to(ROOT)}:{number}: {text.strip()}"
                for argv in _expand(shlex.split(re.sub(r"\[[^\]]*\]", "", text), comments=True)):
                    found.append((where, argv))
    return found


def _expand(words: list[str]) -> list[list[str]]:
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words = words[1:]
    if words[:2] == ["make", "serve"]:
        args = [w.removeprefix("ARGS=") for w in words[2:] if w.startswith("ARGS=")]
        words = ["serve", *(shlex.split(args[0]) if args else [])]
    else:
        words = words[[Path(w).name for w in words].index("hybridserve") + 1 :]
    choices = [w.split("|") if "|" in w else [w] for w in words]
    return [list(argv) for argv in itertools.product(*choices)]


COMMANDS = documented_commands()


@pytest.mark.parametrize("command", [None, *subcommands()])
def test_help_prints_and_exits_zero(command: str | None, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--help"] if command is None else [command, "--help"]
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser().parse_args(argv)
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hybridserve {command or ''}".rstrip())
    if command is not None:  # every flag of the subcommand is in its help, with its text
        for action in subcommands()[command]._actions:
            assert all(option in out for option in action.option_strings), action.dest


def test_help_takes_a_percent_sign_in_a_flag_help(capsys: pytest.CaptureFixture[str]) -> None:
    """A config field's help is plain text: "19% (Q4_x)" once made `serve --help` raise in argparse's formatting."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--help"])
    assert "19% (Q4_x)" in " ".join(capsys.readouterr().out.split())


def test_the_docs_show_commands() -> None:
    """The extraction below finds what it should (a change to the docs' form would otherwise leave it checking
    nothing): the README's quick start and each subcommand at least once."""
    argvs = [argv for _, argv in COMMANDS]
    assert ["serve", "--port", "8080", "--api-key", "secret"] in argvs  # make serve ARGS="..."
    assert ["serve", "--help"] in argvs
    assert {argv[0] for argv in argvs if argv} == set(subcommands())


@pytest.mark.parametrize(
    ("where", "argv"),
    [pytest.param(where, argv, id=f"{where.partition(': ')[0]} {shlex.join(argv)}") for where, argv in COMMANDS],
)
def test_every_documented_command_parses(where: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    parser = cli.build_parser()
    try:
        args = parser.parse_args(argv)
        command = subcommands()[args.command]
        if args.command == "serve":
            model_configs(args, command)
            config_from(DeploymentConfig, args)
            cli.batch_settings(args, command)
        elif args.command == "worker":
            cli.engine_config(args)
    except SystemExit as exc:
        if exc.code != 0:  # --help is a documented command too
            pytest.fail(f"{where}\n  the parser refuses {argv}: {capsys.readouterr().err.strip().splitlines()[-1]}")
    except InvalidParameter as exc:
        pytest.fail(f"{where}\n  the configs refuse {argv}: --{exc.param.replace('_', '-')}: {exc}")
