import dataclasses

import pytest

from hybridserve.config import EngineConfig, ExtensionConfig, ServingConfig, parse_bytes
from hybridserve.serving import cli
from tests.serving.helpers import serve_with_engine


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1073741824", 1073741824),
        ("1.5G", 3 * 1024**3 // 2),
        ("2GB", 2 * 10**9),
        ("64kib", 65536),
        ("7", 7),
    ],
)
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "GiB", "2 parsecs", "-1", "1e9"])
def test_parse_bytes_rejects(text):
    with pytest.raises(Exception, match="expected a size"):
        parse_bytes(text)


@pytest.fixture(autouse=True)
def _no_prefault_from_the_environment(monkeypatch):
    """tests/conftest.py sets $HYBRIDSERVE_KV_CACHE_PREFAULT=0 for the servers tests start; the flag's default here
    is the config's own."""
    monkeypatch.delenv("HYBRIDSERVE_KV_CACHE_PREFAULT", raising=False)


def serve_parser():
    parser = cli.build_parser()
    return parser, parser._subparsers._group_actions[0].choices["serve"]


def test_defaults_come_from_engine_config_and_every_flag_has_help():
    parser, serve = serve_parser()
    args = parser.parse_args(["serve"])
    assert cli.engine_config(args) == EngineConfig()
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    for action in serve._actions:
        assert action.help, action.dest


def test_flags_map_to_engine_config():
    args = cli.build_parser().parse_args(
        [
            "serve",
            "model.gguf",
            "--dtype",
            "float16",
            "--device",
            "cpu",
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "512",
            "--block-size",
            "32",
            "--kv-cache-memory-bytes",
            "512MiB",
            "--num-kv-blocks",
            "100",
            "--served-model-name",
            "m",
            "--no-enable-prefix-caching",
            "--seed",
            "3",
            "--long-prefill-token-threshold",
            "64",
            "--num-state-slots",
            "5",
            "--num-state-snapshots",
            "7",
        ]
    )
    assert cli.config_from(ServingConfig, args) == ServingConfig(served_model_name="m")
    assert cli.engine_config(args) == EngineConfig.of(
        model="model.gguf",
        dtype="float16",
        device="cpu",
        max_model_len=4096,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        block_size=32,
        kv_cache_memory_bytes=512 * 1024**2,
        num_kv_blocks=100,
        num_state_slots=5,
        num_state_snapshots=7,
        enable_prefix_caching=False,
        long_prefill_token_threshold=64,
        seed=3,
    )


def test_every_engine_config_field_has_one_flag_with_its_default():
    _, serve = serve_parser()
    parts = [type(getattr(EngineConfig(), f.name)) for f in dataclasses.fields(EngineConfig)] + [ServingConfig]
    fields = {f.name: f.default for part in parts for f in dataclasses.fields(part)}
    actions = [action for action in serve._actions if action.dest in fields]
    assert sorted(action.dest for action in actions) == sorted(fields)
    assert {action.dest: action.default for action in actions} == fields


def test_bool_fields_are_flag_pairs_and_a_size_is_a_usage_error(capsys):
    args = cli.build_parser().parse_args(["serve", "--no-native-kernels", "--kv-cache-memory-bytes", "1.5G"])
    assert cli.engine_config(args) == EngineConfig.of(native_kernels=False, kv_cache_memory_bytes=3 * 1024**3 // 2)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--kv-cache-memory-bytes", "2 parsecs"])
    assert (
        "argument --kv-cache-memory-bytes: expected a size such as 2GiB, 512MiB or 1073741824, got '2 parsecs'"
        in capsys.readouterr().err
    )


def test_invalid_config_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--block-size", "0"])
    assert exit_info.value.code == 2
    assert "--block-size: block_size must be positive, got 0" in capsys.readouterr().err


def test_serve_builds_the_engine_and_runs_uvicorn(monkeypatch, tokenizer):
    from tests.serving.fake_engine import FakeEngine
    from tests.serving.helpers import PARIS

    seen = {}
    engine = FakeEngine(tokenizer, [PARIS])
    engine.shutdown = lambda: seen.setdefault("shutdown", True)

    def build_engine(config):
        seen["config"] = config
        return engine

    def run(server):
        seen["server"] = (server.config.host, server.config.port, server.model_name)

    serve_with_engine(monkeypatch, build_engine)
    monkeypatch.setattr(cli.ReadyServer, "run", run)
    cli.main(["serve", "--port", "9123", "--api-key", "k", "--max-num-seqs", "4"])
    assert seen == {
        "config": EngineConfig.of(max_num_seqs=4),
        "server": ("127.0.0.1", 9123, "smollm2"),
        "shutdown": True,
    }


POLICY_ENV = "HYBRIDSERVE_KIMI_PARAM_POLICY"


def extension_config(argv: list[str]) -> ExtensionConfig:
    return cli.config_from(ExtensionConfig, cli.build_parser().parse_args(["serve", *argv]))


def test_kimi_param_policy_flag(monkeypatch):
    monkeypatch.delenv(POLICY_ENV, raising=False)
    assert extension_config([]) == ExtensionConfig(kimi_param_policy=False)
    assert extension_config(["--kimi-param-policy"]) == ExtensionConfig(kimi_param_policy=True)


def test_kimi_param_policy_default_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv(POLICY_ENV, "1")
    assert extension_config([]).kimi_param_policy is True
    assert extension_config(["--no-kimi-param-policy"]).kimi_param_policy is False
    monkeypatch.setenv(POLICY_ENV, "0")
    assert extension_config([]).kimi_param_policy is False
    monkeypatch.setenv(POLICY_ENV, "yes")
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser()
    assert exit_info.value.code == 2
    assert f"${POLICY_ENV} must be 1 or 0, got 'yes'" in capsys.readouterr().err


def serve_app_arguments(monkeypatch, engine, argv: list[str]) -> dict:
    """What `hybridserve serve ARGV` hands build_app, by name (the app itself never built or served)."""
    from hybridserve.serving import app

    seen = {}
    engine.shutdown = lambda: None

    def build_app(engine, api_key, data_dir, retention, parsers, pool, extension, **settings):
        seen.update(extension=extension, **settings)
        return object()  # never served: ReadyServer.run is stubbed

    serve_with_engine(monkeypatch, lambda config: engine)
    monkeypatch.setattr(app, "build_app", build_app)
    monkeypatch.setattr(cli.ReadyServer, "run", lambda server: None)
    cli.main(["serve", *argv])
    return seen


def test_serve_hands_the_extension_its_config(monkeypatch, tokenizer):
    from hybridserve.serving.extensions.kimi_k3 import KimiK3ServingExtension
    from tests.serving.fake_engine import FakeEngine
    from tests.serving.helpers import PARIS

    engine = FakeEngine(tokenizer, [PARIS])
    engine.model_type = "kimi_k3"
    monkeypatch.delenv(POLICY_ENV, raising=False)
    seen = serve_app_arguments(monkeypatch, engine, ["--kimi-param-policy"])
    assert isinstance(seen["extension"], KimiK3ServingExtension)
    assert seen["extension"].config == ExtensionConfig(kimi_param_policy=True)
    assert seen["scheduling_policy"] == "fcfs"


def test_scheduling_policy_flag(monkeypatch, tokenizer, capsys):
    from tests.serving.fake_engine import FakeEngine
    from tests.serving.helpers import PARIS

    seen = serve_app_arguments(monkeypatch, FakeEngine(tokenizer, [PARIS]), ["--scheduling-policy", "priority"])
    assert seen["scheduling_policy"] == "priority"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--scheduling-policy", "lottery"])
    assert "argument --scheduling-policy: invalid choice: 'lottery'" in capsys.readouterr().err
