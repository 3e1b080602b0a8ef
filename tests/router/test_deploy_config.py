"""The deployment surface: serve's worker flags, the YAML deployment file, and the worker's listen check."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridserve.config import DeploymentConfig
from hybridserve.serving import cli
from hybridserve.serving.flags import config_from


def _deployment(argv: list[str]) -> DeploymentConfig:
    args, _ = cli.parse_args(["serve", *argv])
    return config_from(DeploymentConfig, args)


def test_worker_flags_repeat_and_choose_the_defaults() -> None:
    assert _deployment([]).local_workers == 1 and _deployment([]).routing_policy == "round_robin"
    two = _deployment(["--worker", "tcp://127.0.0.1:8100", "--worker", "tcp://127.0.0.1:8101"])
    assert two.workers == ["tcp://127.0.0.1:8100", "tcp://127.0.0.1:8101"]
    assert (two.local_workers, two.routing_policy) == (0, "kv_aware")
    assert _deployment(["--num-workers", "3", "--routing", "least_load"]).routing_policy == "least_load"


def test_a_deployment_file_sets_defaults_and_the_command_line_wins(tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        "workers: [tcp://10.0.0.5:8100, tcp://10.0.0.6:8100]\nrouting: least_load\nworker-timeout: 4\n"
        "kv_cache_memory_bytes: 512MiB\nport: 9000\n"
    )
    args, _ = cli.parse_args(["serve", "--config", str(deploy), "--routing", "round_robin"])
    assert config_from(DeploymentConfig, args) == DeploymentConfig(
        workers=["tcp://10.0.0.5:8100", "tcp://10.0.0.6:8100"], routing="round_robin", worker_timeout=4
    )
    assert (args.kv_cache_memory_bytes, args.port) == (512 * 1024**2, 9000)


def test_a_deployment_file_with_an_unknown_key_is_a_usage_error(tmp_path: Path, capsys) -> None:
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text("workers: [tcp://10.0.0.5:8100]\nrouter: fast\n")
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["serve", "--config", str(deploy)])
    assert exit_info.value.code == 2
    assert f"--config {deploy}: unknown keys ['router'] (keys are serve's flag names)" in capsys.readouterr().err


def test_a_worker_off_loopback_needs_a_shared_secret(capsys, monkeypatch) -> None:
    monkeypatch.delenv("HYBRIDSERVE_WORKER_API_KEY", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["worker", "--listen", "tcp://0.0.0.0:8100"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--listen tcp://0.0.0.0:8100 is not a loopback address: give the worker a shared secret" in err


def test_no_worker_at_all_is_refused() -> None:
    with pytest.raises(ValueError, match="a deployment needs at least one worker"):
        DeploymentConfig(num_workers=0)


def test_disaggregated_pools_from_flags_and_file(tmp_path: Path) -> None:
    local = _deployment(["--num-prefill-workers", "1", "--num-decode-workers", "2"])
    assert (local.disaggregated, local.local_workers, local.num_all_workers, local.routing_policy) == (
        True,
        0,
        3,
        "kv_aware",
    )
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(
        "prefill_workers: [tcp://10.0.0.1:8100]\ndecode_workers: [tcp://10.0.0.2:8100]\nmax-local-prefill-tokens: 0\n"
    )
    args, _ = cli.parse_args(["serve", "--config", str(deploy)])
    assert config_from(DeploymentConfig, args) == DeploymentConfig(
        prefill_workers=["tcp://10.0.0.1:8100"], decode_workers=["tcp://10.0.0.2:8100"], max_local_prefill_tokens=0
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"num_prefill_workers": 1},
            "a disaggregated deployment needs decode workers too: --num-decode-workers or --decode-worker "
            "(it has 1 prefill and 0 decode workers)",
        ),
        (
            {"decode_workers": ["tcp://127.0.0.1:8100"]},
            "a disaggregated deployment needs prefill workers too: --num-prefill-workers or --prefill-worker "
            "(it has 0 prefill and 1 decode workers)",
        ),
        (
            {"num_prefill_workers": 1, "num_decode_workers": 1, "num_workers": 1},
            "a deployment is either aggregated (--num-workers, --worker) or disaggregated (prefill and decode "
            "workers), not both",
        ),
        ({"max_local_prefill_tokens": -1}, "max_local_prefill_tokens must be >= 0, got -1"),
    ],
)
def test_bad_pools_are_refused_naming_what_is_missing(config: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        DeploymentConfig(**config)
    assert str(info.value) == message
