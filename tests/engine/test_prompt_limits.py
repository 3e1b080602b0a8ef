"""A prompt that leaves no room to generate: the same refusal from the frontend's check and from the engine."""

from __future__ import annotations

import pytest

from hybridserve.engine.llm import LLM
from hybridserve.engine.protocol import EngineCoreRequest, FinishReason
from hybridserve.sampling_params import InvalidParameter, SamplingParams

MAX_MODEL_LEN = 32
TOO_LONG = (
    "this model's maximum context length is 32 tokens, but the prompt has 32 tokens, which leaves no room to generate"
)


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(
        str(smollm2_dir),
        dtype="float32",
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=8,
        kv_cache_prefault=False,
    )


def test_the_frontend_refuses_before_the_engine(llm):
    with pytest.raises(InvalidParameter) as err:
        llm.generate([list(range(1, MAX_MODEL_LEN + 1))])
    assert (err.value.param, str(err.value)) == ("prompt", TOO_LONG)
    with pytest.raises(InvalidParameter) as err:
        llm.generate([[]])
    assert (err.value.param, str(err.value)) == ("prompt", "the prompt is empty")
    assert not llm.core.has_work()


@pytest.mark.parametrize(
    ("prompt", "error"), [(list(range(1, MAX_MODEL_LEN + 1)), TOO_LONG), ([], "the prompt is empty")]
)
def test_the_engine_refuses_a_client_that_skipped_the_frontend_with_the_same_message(llm, prompt, error):
    llm.core.add_request(EngineCoreRequest("direct", prompt, SamplingParams(max_tokens=1), [2], 0.0))
    [out] = llm.core.step().outputs
    assert (out.request_id, out.finish_reason, out.error) == ("direct", FinishReason.ERROR, error)
    assert not llm.core.has_work()
    llm.core.check_integrity()


def test_a_prompt_one_token_shorter_runs(llm):
    [final] = llm.generate([list(range(1, MAX_MODEL_LEN))], SamplingParams(temperature=0.0, max_tokens=1))
    assert len(final.outputs[0].token_ids) == 1
