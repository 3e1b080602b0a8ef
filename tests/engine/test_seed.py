"""The engine's --seed: requests without a seed of their own are reproducible run to run."""

from hybridserve.engine.llm import LLM
from hybridserve.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)


def _unseeded_sample(smollm2_dir, seed: int) -> list[int]:
    llm = LLM(str(smollm2_dir), dtype="float32", device="cpu", seed=seed, kv_cache_prefault=False)
    return llm.generate(["Once upon a time"], PARAMS)[0].outputs[0].token_ids


def test_engine_seed_fixes_unseeded_sampling(smollm2_dir):
    first = _unseeded_sample(smollm2_dir, 3)
    assert _unseeded_sample(smollm2_dir, 3) == first
    assert _unseeded_sample(smollm2_dir, 4) != first
