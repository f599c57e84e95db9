"""A byte-level BPE vocabulary trained on text that ships with Python.

The demo models need a real tokenizer so llama.cpp can tokenize prompts and so token counts mean
something, but downloading one would make the tool depend on the network. CPython ships ~465 KB of
English prose and code in ``pydoc_data.topics``; training a small GPT-2 style BPE on it takes a couple
of seconds and gives a vocabulary llama.cpp accepts as ``tokenizer.ggml.model = gpt2`` with the
``qwen2`` pre-tokenizer.

The corpus is whatever the running Python ships, so a vocabulary (and a demo model built on it) is
deterministic per Python version, not across versions.
"""

from __future__ import annotations

import heapq
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache

from tuner.core.errors import UsageError

TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

N_BYTE_TOKENS = 256

# The Qwen2 split rule (the one llama.cpp applies for tokenizer.ggml.pre = "qwen2"):
#   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
# Python's `re` has no \p{..}; \w is letters + numbers + "_", so a letter is [^\W\d_] and
# "neither letter nor number" is [^\w] or "_". Qwen2 splits numbers into single digits.
_LETTERS = r"[^\W\d_]"
_NOT_LETTER_NUMBER_OR_SPACE = r"(?:[^\s\w]|_)"
PRETOKENIZE_PATTERN = re.compile(
    # Contractions spelled out per letter, as llama.cpp does: (?i:) would also fold "ſ" and "K" (Kelvin).
    r"'(?:[sS]|[tT]|[rR][eE]|[vV][eE]|[mM]|[lL][lL]|[dD])"
    rf"|(?:[^\r\n\w]|_)?{_LETTERS}+"
    r"|\d"
    rf"| ?{_NOT_LETTER_NUMBER_OR_SPACE}+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, so every token is a visible string.

    Printable Latin-1 bytes map to themselves; the rest (controls, space, a few others) are shifted
    to code points 256 and up in byte order. A space therefore shows as "Ġ" and a newline as "Ċ".
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(N_BYTE_TOKENS):
        if b not in mapping:
            mapping[b] = chr(N_BYTE_TOKENS + shifted)
            shifted += 1
    return mapping


@cache
def unicode_to_byte() -> dict[str, int]:
    return {ch: b for b, ch in byte_to_unicode().items()}


def pretokenize(text: str) -> list[str]:
    return PRETOKENIZE_PATTERN.findall(text)


@dataclass(frozen=True, slots=True)
class Vocab:
    """Tokens, merges and special ids in the shape GGUF's tokenizer.ggml.* keys want them."""

    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    bos_id: int
    eos_id: int
    pad_id: int
    endoftext_id: int
    im_start_id: int
    im_end_id: int
    add_bos: bool = False
    # Lookup tables derived from the fields above; built once in __post_init__.
    _token_ids: dict[str, int] = field(init=False, repr=False, compare=False)
    _merge_ranks: dict[tuple[int, int], tuple[int, int]] = field(init=False, repr=False, compare=False)
    _special_ids: dict[str, int] = field(init=False, repr=False, compare=False)
    _special_split: re.Pattern[str] | None = field(init=False, repr=False, compare=False)
    _word_cache: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.token_types):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.token_types)} token types")
        token_ids = {tok: i for i, tok in enumerate(self.tokens)}
        ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, merge in enumerate(self.merges):
            left, right = merge.split(" ")
            pair = (token_ids[left], token_ids[right])
            ranks.setdefault(pair, (rank, token_ids[left + right]))
        specials = {
            tok: i for i, (tok, kind) in enumerate(zip(self.tokens, self.token_types)) if kind == TOKEN_TYPE_CONTROL
        }
        # Longest first so a special that prefixes another cannot shadow it.
        alternatives = "|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True))
        object.__setattr__(self, "_token_ids", token_ids)
        object.__setattr__(self, "_merge_ranks", ranks)
        object.__setattr__(self, "_special_ids", specials)
        object.__setattr__(self, "_special_split", re.compile(f"({alternatives})") if specials else None)
        object.__setattr__(self, "_word_cache", {})

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def token_id(self, token: str) -> int:
        return self._token_ids[token]

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids for ``text``; with ``parse_special`` the literal "<|im_start|>" etc. become one id each,
        as llama-server does for prompts."""
        if not parse_special or self._special_split is None:
            return self._encode_ordinary(text)
        ids: list[int] = []
        for i, piece in enumerate(self._special_split.split(text)):
            if i % 2:
                ids.append(self._special_ids[piece])
            elif piece:
                ids.extend(self._encode_ordinary(piece))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        to_byte = unicode_to_byte()
        out = bytearray()
        for i in ids:
            token = self.tokens[i]
            if self.token_types[i] == TOKEN_TYPE_CONTROL:
                out += token.encode("utf-8")
            else:
                out += bytes(to_byte[ch] for ch in token)
        # A cut in the middle of a multi-byte character is normal for partial output.
        return out.decode("utf-8", errors="replace")

    def _encode_ordinary(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in pretokenize(text):
            cached = self._word_cache.get(word)
            if cached is None:
                cached = self._encode_word(word)
                if len(self._word_cache) < 100_000:  # bound memory on long inputs
                    self._word_cache[word] = cached
            ids.extend(cached)
        return ids

    def _encode_word(self, word: str) -> tuple[int, ...]:
        # Byte tokens sit at ids 0..255 in byte order, so the start is the raw bytes.
        symbols = list(word.encode("utf-8"))
        ranks = self._merge_ranks
        while len(symbols) > 1:
            best_rank = -1
            best_pair = (0, 0)
            merged = 0
            for pair in zip(symbols, symbols[1:]):
                found = ranks.get(pair)
                if found is not None and (best_rank < 0 or found[0] < best_rank):
                    best_rank, merged = found
                    best_pair = pair
            if best_rank < 0:
                break
            symbols = _merge_pair(symbols, best_pair, merged)
        return tuple(symbols)


def _merge_pair(symbols: Sequence[int], pair: tuple[int, int], merged: int) -> list[int]:
    """Replace every non-overlapping occurrence of ``pair``, scanning left to right."""
    first, second = pair
    out: list[int] = []
    i = 0
    n = len(symbols)
    while i < n:
        if i + 1 < n and symbols[i] == first and symbols[i + 1] == second:
            out.append(merged)
            i += 2
        else:
            out.append(symbols[i])
            i += 1
    return out


def corpus_texts() -> list[str]:
    """The training text: pydoc's help topics, in sorted key order so the corpus order is fixed."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_vocab(n_vocab: int = 4096) -> Vocab:
    """Train a byte-level BPE with ``n_vocab`` tokens in total (256 bytes + merges + 3 specials).

    Deterministic: among pairs with equal counts the one with the smallest (left id, right id) wins.
    """
    n_normal = n_vocab - len(SPECIAL_TOKENS)
    if n_normal < N_BYTE_TOKENS:
        raise UsageError(f"n_vocab={n_vocab} is too small: use at least {N_BYTE_TOKENS + len(SPECIAL_TOKENS)}")

    word_freqs: Counter[str] = Counter()
    for text in corpus_texts():
        word_freqs.update(pretokenize(text))

    to_char = byte_to_unicode()
    tokens = [to_char[b] for b in range(N_BYTE_TOKENS)]
    merges = _learn_merges(word_freqs, tokens, n_normal)
    if len(tokens) < n_normal:
        raise UsageError(
            f"the training text only supports {len(tokens) + len(SPECIAL_TOKENS)} tokens, "
            f"not n_vocab={n_vocab}: use a smaller n_vocab"
        )

    first_special = len(tokens)
    tokens.extend(SPECIAL_TOKENS)
    endoftext_id, im_start_id, im_end_id = range(first_special, first_special + len(SPECIAL_TOKENS))
    types = [TOKEN_TYPE_NORMAL] * first_special + [TOKEN_TYPE_CONTROL] * len(SPECIAL_TOKENS)
    # Qwen convention: bos and pad are <|endoftext|> (bos never added), generation ends at <|im_end|>.
    return Vocab(
        tokens=tuple(tokens),
        token_types=tuple(types),
        merges=tuple(merges),
        bos_id=endoftext_id,
        eos_id=im_end_id,
        pad_id=endoftext_id,
        endoftext_id=endoftext_id,
        im_start_id=im_start_id,
        im_end_id=im_end_id,
        add_bos=False,
    )


def _learn_merges(word_freqs: Counter[str], tokens: list[str], n_tokens: int) -> list[str]:
    """Grow ``tokens`` in place to ``n_tokens`` by greedy pair merging; returns the merges in rank order.

    Works on distinct words weighted by frequency, keeps pair counts up to date incrementally and
    finds the best pair with a lazy max-heap, so each merge only touches the words that contain it.
    """
    words = [list(word.encode("utf-8")) for word in word_freqs]
    freqs = list(word_freqs.values())
    pair_counts: defaultdict[tuple[int, int], int] = defaultdict(int)
    pair_words: defaultdict[tuple[int, int], set[int]] = defaultdict(set)
    for index, (symbols, freq) in enumerate(zip(words, freqs)):
        for pair in zip(symbols, symbols[1:]):
            pair_counts[pair] += freq
            pair_words[pair].add(index)

    # Entries are (-count, left, right); an entry is stale once its count no longer matches.
    heap = [(-count, left, right) for (left, right), count in pair_counts.items()]
    heapq.heapify(heap)
    token_ids = {tok: i for i, tok in enumerate(tokens)}
    merges: list[str] = []
    seen_merges: set[tuple[int, int]] = set()

    while len(tokens) < n_tokens and heap:
        neg_count, left, right = heapq.heappop(heap)
        pair = (left, right)
        if pair_counts.get(pair, 0) != -neg_count or neg_count == 0:
            continue
        text = tokens[left] + tokens[right]
        merged = token_ids.get(text)
        if merged is None:
            # Two different splits can spell the same string; reuse the id so tokens stay unique.
            merged = len(tokens)
            tokens.append(text)
            token_ids[text] = merged
        if pair not in seen_merges:
            seen_merges.add(pair)
            merges.append(f"{tokens[left]} {tokens[right]}")

        touched: set[tuple[int, int]] = set()
        for index in pair_words.pop(pair):
            symbols = words[index]
            freq = freqs[index]
            for old in zip(symbols, symbols[1:]):
                pair_counts[old] -= freq
                touched.add(old)
            symbols = _merge_pair(symbols, pair, merged)
            words[index] = symbols
            for new in zip(symbols, symbols[1:]):
                pair_counts[new] += freq
                pair_words[new].add(index)
                touched.add(new)
        for changed in touched:
            count = pair_counts[changed]
            if count > 0:
                heapq.heappush(heap, (-count, changed[0], changed[1]))
            else:
                del pair_counts[changed]
    return merges


def synthetic_vocab(n_vocab: int) -> Vocab:
    """A BPE vocabulary of a real model's size for shape-true models: the 256 byte tokens, synthetic
    fillers that llama.cpp's BPE loader accepts, the three control tokens last. Text encodes byte by byte."""
    to_char = byte_to_unicode()
    space = to_char[ord(" ")]
    n_fill = n_vocab - N_BYTE_TOKENS - len(SPECIAL_TOKENS)
    if n_fill < 1:
        raise UsageError(f"n_vocab={n_vocab} is too small: use at least {N_BYTE_TOKENS + len(SPECIAL_TOKENS) + 1}")
    # The loader needs one merge (an empty merges array is not written), so the first filler is its result.
    tokens = [to_char[b] for b in range(N_BYTE_TOKENS)] + [space * 2] + [f"t{i}" for i in range(n_fill - 1)]
    first_special = len(tokens)
    tokens.extend(SPECIAL_TOKENS)
    types = [TOKEN_TYPE_NORMAL] * first_special + [TOKEN_TYPE_CONTROL] * len(SPECIAL_TOKENS)
    endoftext_id, im_start_id, im_end_id = range(first_special, first_special + len(SPECIAL_TOKENS))
    return Vocab(tokens=tuple(tokens), token_types=tuple(types), merges=(f"{space} {space}",), bos_id=endoftext_id,
                 eos_id=im_end_id, pad_id=endoftext_id, endoftext_id=endoftext_id, im_start_id=im_start_id,
                 im_end_id=im_end_id, add_bos=False)
