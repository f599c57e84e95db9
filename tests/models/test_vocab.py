from __future__ import annotations

import pytest

from tuner.core.errors import UsageError
from tuner.models.vocab import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    Vocab,
    byte_to_unicode,
    corpus_texts,
    pretokenize,
    train_vocab,
)

ROUND_TRIP_TEXTS = [
    "",
    "Hello, world!",
    "def f(x):\n    return x ** 2  # square\n",
    "I'm sure they'll say WE'VE done it, haven't we?",
    "naïve café crème brûlée — “quotes” … ½ ² Ⅻ",
    "日本語のテキスト, 中文文本, 한국어 텍스트",
    "Ελληνικά και русский текст",
    "emoji 😀🚀 and a ZWJ family 👨‍👩‍👧 and flags 🇩🇪",
    "control \x00\x01\x1b[0m\x7f bytes and \r\n line endings\r\n",
    "numbers 3.14159 1e-10 0x1F 1_000_000 ١٢٣",
    "tabs\tand    runs of   spaces   \n\n\n   trailing   ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "a half special <|im_sta and <|endoftext|> mid-text",
]


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return train_vocab()


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip(vocab: Vocab, text: str) -> None:
    assert vocab.decode(vocab.encode(text)) == text
    assert vocab.decode(vocab.encode(text, parse_special=False)) == text


def test_round_trip_whole_training_corpus(vocab: Vocab) -> None:
    text = "".join(corpus_texts())
    ids = vocab.encode(text)
    assert vocab.decode(ids) == text
    # A trained vocabulary compresses its own corpus well beyond one token per byte.
    assert len(text.encode("utf-8")) / len(ids) > 3.5


def test_size_and_uniqueness(vocab: Vocab) -> None:
    assert vocab.n_vocab == 4096
    assert len(vocab.token_types) == 4096
    assert len(set(vocab.tokens)) == len(vocab.tokens)
    assert len(set(vocab.merges)) == len(vocab.merges)


def test_all_byte_tokens_present(vocab: Vocab) -> None:
    mapping = byte_to_unicode()
    assert len(set(mapping.values())) == 256
    assert mapping[ord(" ")] == "Ġ"
    assert mapping[ord("\n")] == "Ċ"
    # Byte b is token id b, which is what encode relies on.
    assert vocab.tokens[:256] == tuple(mapping[b] for b in range(256))
    assert all(t == TOKEN_TYPE_NORMAL for t in vocab.token_types[:256])


def test_specials_are_control_tokens_at_the_end(vocab: Vocab) -> None:
    assert vocab.tokens[-3:] == (ENDOFTEXT, IM_START, IM_END)
    assert vocab.token_types[-3:] == (TOKEN_TYPE_CONTROL,) * 3
    assert set(vocab.token_types[:-3]) == {TOKEN_TYPE_NORMAL}
    assert vocab.eos_id == vocab.im_end_id == vocab.token_id(IM_END)
    assert vocab.bos_id == vocab.pad_id == vocab.endoftext_id == vocab.token_id(ENDOFTEXT)
    assert vocab.im_start_id == vocab.token_id(IM_START)
    assert vocab.add_bos is False


def test_specials_parse_as_one_token(vocab: Vocab) -> None:
    ids = vocab.encode(f"{IM_START}user\nhi{IM_END}")
    assert ids[0] == vocab.im_start_id
    assert ids[-1] == vocab.im_end_id
    plain = vocab.encode(IM_START, parse_special=False)
    assert len(plain) > 1
    assert vocab.im_start_id not in plain


def test_merges_reference_existing_tokens(vocab: Vocab) -> None:
    known = set(vocab.tokens[:-3])
    assert len(vocab.merges) >= vocab.n_vocab - 256 - 3
    for merge in vocab.merges:
        parts = merge.split(" ")
        assert len(parts) == 2, merge
        left, right = parts
        assert left in known and right in known and left + right in known, merge


def test_training_is_deterministic(vocab: Vocab) -> None:
    again = train_vocab()
    assert again == vocab
    assert again.tokens == vocab.tokens and again.merges == vocab.merges
    small = train_vocab(512)
    assert small == train_vocab(512)
    # A smaller vocabulary is a prefix of the larger one: the same merges, learned in the same order.
    assert small.merges == vocab.merges[: len(small.merges)]
    assert small.n_vocab == 512


def test_pretokenizer_follows_qwen2_rules() -> None:
    assert pretokenize("abc123") == ["abc", "1", "2", "3"]
    assert pretokenize("Hello world") == ["Hello", " world"]
    assert pretokenize("it's") == ["it", "'s"]
    assert pretokenize("IT'S") == ["IT", "'S"]
    assert pretokenize("x  = 1") == ["x", " ", " =", " ", "1"]
    assert pretokenize("__init__") == ["__", "init", "__"]
    assert pretokenize("café") == ["café"]


def test_too_small_vocab_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="at least 259"):
        train_vocab(100)
