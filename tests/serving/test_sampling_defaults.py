"""Sampling defaults follow the model (issue 14, item 12): a request that leaves out temperature, top_p, top_k, min_p
or repetition_penalty samples with what the model's generation_config.json recommends, as vLLM does;
`--generation-config none` keeps OpenAI's defaults; a value the request sets always wins."""

import json

import pytest

from hybridserve.config import ServingConfig
from hybridserve.engine.async_llm import sampling_defaults
from hybridserve.sampling_params import SamplingDefaults
from hybridserve.serving import cli
from tests.serving.helpers import QUESTION

CHAT = "/v1/chat/completions"
RECOMMENDED = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.1)
NEUTRAL = (1.0, 1.0, 0, 0.0, 1.0)


def sampled(engine, index: int = -1) -> tuple:
    params = engine.calls[index][1]
    return params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty


def test_left_out_fields_follow_the_model(client, engine):
    engine.sampling_defaults = RECOMMENDED
    client.post(CHAT, json={"messages": QUESTION})
    assert sampled(engine) == (0.6, 0.95, 20, 0.05, 1.1)
    client.post("/v1/completions", json={"prompt": "hi"})
    assert sampled(engine) == (0.6, 0.95, 20, 0.05, 1.1)
    body = client.post("/v1/responses", json={"input": "hi"}).json()
    assert sampled(engine) == (0.6, 0.95, 20, 0.05, 1.1)
    assert (body["temperature"], body["top_p"]) == (0.6, 0.95)  # the response says what it sampled with


def test_fields_the_request_sets_win(client, engine):
    engine.sampling_defaults = RECOMMENDED
    client.post(CHAT, json={"messages": QUESTION, "temperature": 0})
    assert sampled(engine) == (0.0, 0.95, 20, 0.05, 1.1)
    explicit = {"temperature": 1, "top_p": 1, "top_k": -1, "min_p": 0, "repetition_penalty": 1}
    client.post("/v1/completions", json={"prompt": "hi", **explicit})
    assert sampled(engine) == (1.0, 1.0, -1, 0.0, 1.0)
    body = client.post("/v1/responses", json={"input": "hi", "temperature": 0.2, "top_p": 1}).json()
    assert sampled(engine) == (0.2, 1.0, 20, 0.05, 1.1)
    assert (body["temperature"], body["top_p"]) == (0.2, 1.0)


def test_without_a_recommendation_requests_sample_with_openai_defaults(client, engine):
    client.post(CHAT, json={"messages": QUESTION})
    assert sampled(engine) == NEUTRAL
    body = client.post("/v1/responses", json={"input": "hi"}).json()
    assert (body["temperature"], body["top_p"]) == (1.0, 1.0)


def test_generation_config_json(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "min_p": None,
                "do_sample": True,
                "eos_token_id": [1, 2],
                "max_new_tokens": 256,
            }
        )
    )
    assert sampling_defaults(tmp_path) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert sampling_defaults(tmp_path, "none") == SamplingDefaults()
    assert sampling_defaults(tmp_path / "no-such-dir") == SamplingDefaults()


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ({"temperature": 5}, "temperature must be in [0, 2], got 5"),
        ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
        ({"top_k": 2.5}, "top_k must be an integer, got 2.5"),
        ({"temperature": "0.6"}, "temperature must be a number, got '0.6'"),
    ],
)
def test_an_invalid_recommendation_stops_the_start(tmp_path, config, problem):
    path = tmp_path / "generation_config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        sampling_defaults(tmp_path)
    assert str(error.value) == f"{path}: {problem}"


def test_the_embedded_model_recommends_nothing(smollm2_dir):
    """SmolLM2's GGUF carries no sampling metadata, so its converted generation_config.json has none (see README)."""
    assert set(json.loads((smollm2_dir / "generation_config.json").read_text())) == {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    }
    assert sampling_defaults(smollm2_dir) == SamplingDefaults()


def test_generation_config_flag(capsys):
    parser = cli.build_parser()
    assert cli.config_from(ServingConfig, parser.parse_args(["serve"])).generation_config == "auto"
    args = parser.parse_args(["serve", "--generation-config", "none"])
    assert cli.config_from(ServingConfig, args) == ServingConfig(generation_config="none")
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--generation-config", "vllm"])
    assert "argument --generation-config: invalid choice: 'vllm'" in capsys.readouterr().err
