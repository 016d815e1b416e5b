"""Streamed detokenization: whole characters only, stop strings never leaked, templates."""

from __future__ import annotations

import random

import pytest

from app.tokenization import (
    ChatTemplateError,
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
    apply_chat_template,
    encode_prompt,
    load_tokenizer,
)

ALPHABET = ["a", "b", " ", "<", "/", ">", "é", "€", "𝄞", "中"]


def random_splits(rng: random.Random, items: list, max_piece: int = 4) -> list[list]:
    pieces, i = [], 0
    while i < len(items):
        n = rng.randint(0, max_piece)  # empty pieces too: the engine may send empty chunks
        pieces.append(items[i : i + n])
        i += n
    return pieces


class TestIncrementalDetokenizer:
    def test_round_trips_multibyte_text_in_any_split(self, tokenizer):
        rng = random.Random(0)
        for _ in range(200):
            text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 20)))
            detokenizer = IncrementalDetokenizer(tokenizer, list(b"prompt "))
            deltas = [detokenizer.decode(p) for p in random_splits(rng, list(text.encode()))]
            deltas.append(detokenizer.flush())
            assert "".join(deltas) == text
            assert all("\ufffd" not in d for d in deltas), deltas

    def test_holds_back_an_incomplete_character(self, tokenizer):
        clef = "𝄞".encode()  # four bytes
        detokenizer = IncrementalDetokenizer(tokenizer)
        assert [detokenizer.decode([b]) for b in clef[:3]] == ["", "", ""]
        assert detokenizer.decode([clef[3]]) == "𝄞"

    def test_flush_emits_bytes_that_never_completed(self, tokenizer):
        detokenizer = IncrementalDetokenizer(tokenizer)
        assert detokenizer.decode([ord("a")]) == "a"
        assert detokenizer.decode([0xE2, 0x82]) == ""
        assert detokenizer.flush() == "\ufffd"

    def test_special_tokens_are_not_text(self, tokenizer):
        detokenizer = IncrementalDetokenizer(tokenizer)
        assert detokenizer.decode([ord("o"), ord("k"), tokenizer.eos_token_id]) == "ok"
        assert detokenizer.flush() == ""

    def test_leading_space_of_a_word_piece_after_the_prompt(self):
        """SentencePiece-style tokenizers drop a leading space when a token is decoded alone;
        decoding with the prompt's last tokens as context keeps it."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3, "!": 4}
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
        assert tokenizer.decode([2]) == "world"  # alone, the space is gone

        detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids=[1])
        deltas = [detokenizer.decode([t]) for t in (2, 3, 4)]
        assert deltas == [" world", " again", "!"]


def first_stop_cut(text: str, stops: list[str]) -> str:
    """The reference: grow the text one character at a time; cut at the first stop to appear
    (the longest one when several complete on the same character)."""
    for end in range(len(text) + 1):
        done = [stop for stop in stops if text[:end].endswith(stop)]
        if done:
            return text[: end - max(map(len, done))]
    return text


class TestStopStringMatcher:
    def test_emits_only_text_before_the_first_stop(self):
        rng = random.Random(1)
        for _ in range(500):
            stops = ["".join(rng.choice("ab<") for _ in range(rng.randint(1, 3))) for _ in range(2)]
            text = "".join(rng.choice("ab<c") for _ in range(rng.randint(0, 16)))
            expected = first_stop_cut(text, stops)

            matcher = StopStringMatcher(stops)
            emitted = ""
            for piece in random_splits(rng, list(text)):
                emitted += matcher.feed("".join(piece))
                # Nothing emitted is ever taken back: it is a prefix of the final answer.
                assert expected.startswith(emitted), (text, stops, emitted)
                # Nothing is held back longer than a stop string could still need.
                assert len(matcher.held_back) < max(map(len, stops))
            emitted += matcher.flush()
            assert emitted == expected, (text, stops)
            assert matcher.stopped == any(s in text for s in stops)

    def test_holds_back_a_possible_stop_then_releases_it(self):
        matcher = StopStringMatcher(["</s>"])
        assert matcher.feed("hi </") == "hi "
        assert matcher.feed("b") == "</b"
        assert not matcher.stopped

    def test_stop_split_over_deltas(self):
        matcher = StopStringMatcher(["STOP"])
        assert matcher.feed("aST") == "a"
        assert matcher.feed("OP and more") == ""
        assert matcher.stopped
        assert matcher.feed("later") == "" and matcher.flush() == ""

    def test_the_stop_completed_first_wins(self):
        matcher = StopStringMatcher(["cd", "b"])
        assert matcher.feed("abcd") == "a"
        # "baa" starts first, but "a" completes first.
        matcher = StopStringMatcher(["a", "baa"])
        assert matcher.feed("bbaac") == "bb"

    def test_empty_stop_is_refused(self):
        with pytest.raises(ValueError):
            StopStringMatcher([""])


class TestTextStream:
    def test_stop_string_straddling_a_multibyte_character(self, tokenizer):
        stream = TextStream(tokenizer, stop=["€!"])
        deltas = [stream.add([b]) for b in "x€!y".encode()]
        assert "".join(deltas) == "x"
        assert stream.stopped
        assert stream.num_tokens == len("x€!".encode())

    def test_finish_flushes_held_back_text(self, tokenizer):
        stream = TextStream(tokenizer, stop=["<end>"])
        assert stream.add(list(b"ok <en")) == "ok "
        assert stream.finish() == "<en"


class TestTemplates:
    def test_chat_template_writes_its_own_special_tokens(self, tokenizer):
        ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
        assert ids[0] == tokenizer.bos_token_id
        assert ids.count(tokenizer.bos_token_id) == 1
        assert tokenizer.decode(ids).endswith("<|assistant|>\n")

    def test_template_errors_are_chat_template_errors(self, tokenizer):
        with pytest.raises(ChatTemplateError, match="tool"):
            apply_chat_template(tokenizer, [{"role": "tool", "content": "x"}])

    def test_encode_prompt_is_the_text_bytes(self, tokenizer):
        assert encode_prompt(tokenizer, "hé") == list("hé".encode())

    def test_load_tokenizer_from_a_folder(self, tokenizer, tmp_path):
        tokenizer.save_pretrained(tmp_path)
        loaded = load_tokenizer(tmp_path)
        assert loaded.encode("añ€") == tokenizer.encode("añ€")
        assert loaded.chat_template == tokenizer.chat_template
