"""Incremental detokenization and stop strings: what a client streaming the output reads."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.tiny_models import MULTIBYTE_LINES, build_tokenizer
from tokenizer_worker.detokenizer import IncrementalDetokenizer
from tokenizer_worker.stop_strings import StopStringMatcher
from tokenizer_worker.tokenizer import Tokenizer

ALPHABET = "".join(sorted(set("".join(MULTIBYTE_LINES)))) + "abc XYZ.,\n"


def python_windows(tokenizer: Tokenizer) -> Tokenizer:
    """The tokenizer as a slow one looks to the detokenizer (no Rust backend): windows decoded in Python."""
    slow = Tokenizer(tokenizer.hf, tokenizer.vocab_size, tokenizer.skipped_ids)
    slow._backend = None
    return slow


@pytest.fixture(scope="module", params=["decode-stream", "python-windows"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    """Both ways the detokenizer works: a fast tokenizer's DecodeStream, a slow one's windows."""
    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    build_tokenizer(folder)
    loaded = Tokenizer.load(str(folder))
    return loaded if request.param == "decode-stream" else python_windows(loaded)


@pytest.fixture(scope="module", params=["decode-stream", "python-windows"])
def sentencepiece_tokenizer(request, tmp_path_factory) -> Tokenizer:
    """Llama-2 style: "▁" for spaces, the first token's space stripped, unknown characters as byte tokens."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    merges = [
        ("▁", "h"),
        ("▁h", "e"),
        ("l", "l"),
        ("▁he", "ll"),
        ("▁hell", "o"),
        ("▁", "w"),
        ("o", "r"),
        ("▁w", "or"),
        ("l", "d"),
        ("▁wor", "ld"),
    ]
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{i:02X}>" for i in range(256)], *"▁helowrd", *[a + b for a, b in merges]]
    rust = RustTokenizer(
        models.BPE({p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True)
    )
    rust.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    folder = tmp_path_factory.mktemp("sentencepiece-tokenizer")
    PreTrainedTokenizerFast(
        tokenizer_object=rust, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(folder)
    loaded = Tokenizer.load(str(folder))
    return loaded if request.param == "decode-stream" else python_windows(loaded)


def stream(tokenizer: Tokenizer, ids: list[int], chunk_sizes: list[int], skip_special_tokens: bool = True) -> list[str]:
    """The deltas for `ids` arriving in chunks of the given sizes (cycled), the last chunk final."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    deltas: list[str] = []
    pos = 0
    while pos < len(ids):
        chunk = ids[pos : pos + chunk_sizes[len(deltas) % len(chunk_sizes)]]
        pos += len(chunk)
        deltas.append(detokenizer.step(chunk, final=pos == len(ids)))
    return deltas


# ------------------------------------------------------------------ detokenization


def test_a_tiny_tokenizer_splits_characters_across_tokens(tokenizer):
    # The premise of the tests below: single tokens that decode to broken characters.
    ids = tokenizer.hf.encode("🚀")
    assert len(ids) > 1 and all(tokenizer.decode([i]) == "\ufffd" for i in ids)


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=ALPHABET, max_size=60), chunk_sizes=st.lists(st.integers(1, 4), min_size=1, max_size=5))
def test_deltas_of_valid_text_add_up_to_the_decode_and_never_hold_a_broken_character(tokenizer, text, chunk_sizes):
    ids = tokenizer.hf.encode(text)
    deltas = stream(tokenizer, ids, chunk_sizes)
    assert "".join(deltas) == tokenizer.hf.decode(ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_deltas_of_random_token_ids_add_up_to_the_decode(tokenizer, data):
    # Random ids make invalid UTF-8 and special tokens: whatever decode() says, the stream says too.
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=80))
    chunk_sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    assert "".join(stream(tokenizer, ids, chunk_sizes)) == tokenizer.hf.decode(ids, skip_special_tokens=True)


def test_a_character_is_emitted_whole_with_its_last_token(tokenizer):
    ids = tokenizer.hf.encode("🚀")
    assert stream(tokenizer, ids, [1]) == [""] * (len(ids) - 1) + ["🚀"]


def test_special_tokens_produce_no_text(tokenizer):
    ids = tokenizer.hf.encode("hi") + [tokenizer.hf.convert_tokens_to_ids("<|im_end|>")] + tokenizer.hf.encode(" there")
    assert "".join(stream(tokenizer, ids, [1])) == "hi there"


def test_special_tokens_are_shown_where_the_request_asks(tokenizer):
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.hf.encode("hi") + [end] + tokenizer.hf.encode(" there")
    assert "".join(stream(tokenizer, ids, [1], skip_special_tokens=False)) == "hi<|im_end|> there"


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_deltas_with_special_tokens_shown_add_up_to_the_decode(tokenizer, data):
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=80))
    chunk_sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    deltas = stream(tokenizer, ids, chunk_sizes, skip_special_tokens=False)
    assert "".join(deltas) == tokenizer.hf.decode(ids, skip_special_tokens=False)


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.one_of(st.text(alphabet="helo wrd你好🚀", max_size=8), st.just("</s>")), max_size=8),
    chunk_sizes=st.lists(st.integers(1, 3), min_size=1, max_size=4),
    skip_special_tokens=st.booleans(),
)
def test_sentencepiece_spaces_survive_chunking_and_special_tokens(
    sentencepiece_tokenizer, pieces, chunk_sizes, skip_special_tokens
):
    # A window decoded after a special token must not lose the next word's leading space.
    hf = sentencepiece_tokenizer.hf
    ids = [
        i
        for piece in pieces
        for i in ([hf.eos_token_id] if piece == "</s>" else hf.encode(piece, add_special_tokens=False))
    ]
    deltas = stream(sentencepiece_tokenizer, ids, chunk_sizes, skip_special_tokens)
    assert "".join(deltas) == hf.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in d for d in deltas)


def test_final_step_flushes_an_unfinished_character(tokenizer):
    ids = tokenizer.hf.encode("a🚀")[:-1]  # the rocket's last byte never comes
    deltas = stream(tokenizer, ids, [1])
    assert deltas[-1].endswith("\ufffd")
    assert "".join(deltas) == tokenizer.hf.decode(ids)


def test_each_step_decodes_a_short_window_however_long_the_output(tokenizer):
    decoded_lengths: list[int] = []

    class CountingTokenizer(Tokenizer):
        def decode(self, ids: list[int], *options: bool) -> str:
            decoded_lengths.append(len(ids))
            return super().decode(ids, *options)

    counting = CountingTokenizer(tokenizer.hf, tokenizer.vocab_size, tokenizer.skipped_ids)
    counting._backend = tokenizer.backend
    ids = tokenizer.hf.encode(" ".join(MULTIBYTE_LINES) * 30)
    assert len(ids) > 1000
    detokenizer = IncrementalDetokenizer(counting)
    deltas, windows = [], []
    for i in ids:
        deltas.append(detokenizer.step([i]))
        windows.append(detokenizer.window_tokens)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(windows) <= 12  # the window the next decode reads (the DecodeStream's holds the same)
    assert max(decoded_lengths, default=0) <= 12


# ------------------------------------------------------------------ stop strings


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    """What streams for each delta (the last one final), and whether a stop string ended the output."""
    out = []
    for i, delta in enumerate(deltas):
        text, stopped = matcher.feed(delta, final=i == len(deltas) - 1)
        out.append(text)
        if stopped:
            return out, True
    return out, False


def test_a_stop_string_split_across_deltas_is_held_back_then_cut():
    out, stopped = feed_all(StopStringMatcher(["world"]), ["Hel", "lo wo", "rld!", "more"])
    assert stopped
    assert out == ["Hel", "lo ", ""]


def test_held_text_is_released_when_it_turns_out_not_to_be_a_stop_string():
    out, stopped = feed_all(StopStringMatcher(["world"]), ["say wo", "nders", "."])
    assert not stopped
    assert out == ["say ", "wonders", "."]


def test_held_text_is_flushed_at_the_final_delta():
    out, stopped = feed_all(StopStringMatcher(["world"]), ["hello ", "wor"])
    assert not stopped
    assert out == ["hello ", "wor"]


def test_include_stop_str_in_output_keeps_the_stop_string_and_nothing_after_it():
    out, stopped = feed_all(StopStringMatcher(["world"], include_stop=True), ["hello wor", "ld and more"])
    assert stopped
    assert "".join(out) == "hello world"


def test_among_several_stop_strings_the_earliest_in_the_text_wins():
    out, stopped = feed_all(StopStringMatcher(["world", "lo"]), ["hello world"])
    assert stopped
    assert out == ["hel"]


def test_the_first_stop_string_to_complete_wins_over_a_longer_one_starting_earlier():
    out, _ = feed_all(StopStringMatcher(["abcd", "bc"]), ["abcd"])
    assert out == ["a"]


def test_multibyte_stop_string_matches_across_token_boundaries(tokenizer):
    ids = tokenizer.hf.encode("今天天气很好。你好，世界。")
    detokenizer = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(["世界"])
    out = []
    for i in ids:
        text, stopped = matcher.feed(detokenizer.step([i]))
        out.append(text)
        if stopped:
            break
    assert stopped
    assert "".join(out) == "今天天气很好。你好，"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc世", max_size=30),
    stop=st.lists(st.text(alphabet="abc世", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include_stop=st.booleans(),
)
def test_stop_string_output_does_not_depend_on_how_the_text_is_split(text, stop, cuts, include_stop):
    bounds = sorted({0, len(text), *[c for c in cuts if c < len(text)]})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    out, stopped = feed_all(StopStringMatcher(stop, include_stop), deltas)
    # Reference: scan the whole text for the first position where some stop string ends.
    ends = [(text.find(s) + len(s), -len(s)) for s in stop if s in text]
    if ends:
        end, minus_len = min(ends)
        assert stopped
        assert "".join(out) == text[: end if include_stop else end + minus_len]
    else:
        assert not stopped
        assert "".join(out) == text


def test_a_decode_stream_that_fails_hands_over_to_python_windows_mid_output(tokenizer):
    ids = tokenizer.hf.encode("天气很好 🚀✨ and more")
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.step([i]) for i in ids[:5]]

    class Broken:
        def step(self, backend, token):
            raise Exception("InvalidPrefix")  # what tokenizers raises where a window's text does not extend

    detokenizer._stream = Broken() if detokenizer._stream is not None else None
    deltas += [detokenizer.step([i], final=n == len(ids) - 1) for n, i in enumerate(ids) if n >= 5]
    assert "".join(deltas) == tokenizer.hf.decode(ids)
