"""Tokenizers, corpus loading, the resumable token stream and the eval batches."""

from __future__ import annotations

import json
import sys
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import EXPLORE_FACTOR

from growtrain.data.corpus import DataConfig, DataError, TokenArray, TokenStream, eval_batches, load_corpus
from growtrain.data.tokenizer import ByteTokenizer, HFTokenizerFile, build_tokenizer


def _tokens(array: TokenArray) -> torch.Tensor:
    """A whole token array as one int32 tensor (fine for the small corpora here)."""
    return torch.from_numpy(array.read(0, len(array)).astype("int32"))


def _array(tokens: torch.Tensor) -> TokenArray:
    return TokenArray([tokens.numpy()])


def _all_text(corpus) -> str:
    tok = corpus.tokenizer
    return tok.decode(_tokens(corpus.train).tolist()) + tok.decode(_tokens(corpus.eval).tolist())


# --- tokenizers ------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_non_ascii_text():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🚀\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids + [tok.eos_id]) == text
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "byte")


def test_byte_tokenizer_puts_eos_after_every_document():
    tok = ByteTokenizer()
    flat = tok.encode_documents(["ab", "é", "c"]).tolist()
    assert flat == [97, 98, 256, 0xC3, 0xA9, 256, 99, 256]


def test_unknown_tokenizer_spec_says_what_was_expected():
    with pytest.raises(DataError, match="expected 'byte' or the path of a local tokenizer.json"):
        build_tokenizer("gpt2")


def test_tokenizer_file_without_the_tokenizers_package_asks_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.raises(DataError, match="pip install tokenizers"):
        build_tokenizer(str(tmp_path))


def test_tokenizer_file_is_read_with_its_end_of_text_token(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizerFile)
    assert (tok.eos_id, tok.vocab_size) == (1, 4)
    assert tok.encode("hello world") == [2, 3]
    assert tok.encode_documents(["hello", "world hello"]).tolist() == [2, 1, 3, 2, 1]
    with pytest.raises(DataError, match="no end-of-document token"):
        HFTokenizerFile(tmp_path, eos_token="</s>")


# --- corpora ---------------------------------------------------------------------------------


def test_builtin_pydoc_corpus_is_split_deterministically_and_shuffled_by_seed():
    a = load_corpus(DataConfig(), seed=0)
    b = load_corpus(DataConfig(), seed=0)
    c = load_corpus(DataConfig(), seed=1)
    assert _tokens(a.train).dtype == torch.int32 and _tokens(a.train).dim() == 1
    assert _tokens(a.eval).numel() > 0 and _tokens(a.train).numel() > 10 * _tokens(a.eval).numel()
    assert a.num_documents > 50 and "pydoc_topics" in a.description
    assert torch.equal(_tokens(a.train), _tokens(b.train)) and torch.equal(_tokens(a.eval), _tokens(b.eval))
    # The held-out set is fixed; only the order of the train documents follows the seed.
    assert torch.equal(_tokens(a.eval), _tokens(c.eval))
    assert not torch.equal(_tokens(a.train), _tokens(c.train))
    assert torch.equal(_tokens(a.train).sort().values, _tokens(c.train).sort().values)
    eos = a.tokenizer.eos_id
    n_eos = int((_tokens(a.train) == eos).sum() + (_tokens(a.eval) == eos).sum())
    assert n_eos == a.num_documents and _tokens(a.train)[-1] == eos


def test_stdlib_corpus_with_a_byte_cap_loads_quickly():
    start = time.perf_counter()
    corpus = load_corpus(DataConfig(source="builtin:python_stdlib", max_bytes=200_000), seed=0)
    assert time.perf_counter() - start < 5.0
    n_tokens = _tokens(corpus.train).numel() + _tokens(corpus.eval).numel()
    assert n_tokens - corpus.num_documents == 200_000  # one byte per token, plus an EOS per document
    assert "import" in _all_text(corpus)


def test_byte_cap_keeps_documents_in_order_and_cuts_the_last(tmp_path):
    (tmp_path / "a.txt").write_text("aaaa")
    (tmp_path / "b.txt").write_text("bbbb")
    (tmp_path / "c.txt").write_text("cccc")
    corpus = load_corpus(DataConfig(source=str(tmp_path), max_bytes=6), seed=0)
    assert corpus.num_documents == 2
    assert sorted(_all_text(corpus)) == sorted("aaaabb")


def test_local_text_folder_loads_each_file_as_one_document_recursively(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "one.txt").write_text("first file\nwith two lines\n")
    (tmp_path / "sub" / "two.md").write_text("# second")
    (tmp_path / "sub" / "three.py").write_text("print('third')\n")
    (tmp_path / "ignored.csv").write_text("a,b\n1,2\n")
    corpus = load_corpus(DataConfig(source=str(tmp_path)), seed=0)
    assert corpus.num_documents == 3
    text = _all_text(corpus)
    assert "first file\nwith two lines\n" in text and "# second" in text and "a,b" not in text
    assert _tokens(corpus.eval).numel() > 0 and _tokens(corpus.train).numel() > 0


def test_local_jsonl_file_loads_its_text_field(tmp_path):
    path = tmp_path / "docs.jsonl"
    rows = [{"body": f"document number {i}", "id": i} for i in range(20)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    corpus = load_corpus(DataConfig(source=str(path), text_field="body"), seed=3)
    assert corpus.num_documents == 20
    assert all(r["body"] in _all_text(corpus) for r in rows)


def test_local_parquet_file_loads_its_text_field(tmp_path):
    import datasets

    path = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"text": [f"parquet doc {i}" for i in range(10)], "n": list(range(10))}).to_parquet(
        str(path)
    )
    corpus = load_corpus(DataConfig(source=str(path)), seed=0)
    assert corpus.num_documents == 10
    assert "parquet doc 7" in _all_text(corpus)


def test_jsonl_without_the_text_field_names_the_available_columns(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"content": "x", "meta": 1}\n')
    with pytest.raises(DataError, match=r"no column 'text'.*content.*meta"):
        load_corpus(DataConfig(source=str(path)), seed=0)


def test_hub_name_fails_at_once_when_the_hub_is_offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(DataError, match="is not a local path, and the Hugging Face hub is offline"):
        load_corpus(DataConfig(source="someone/some_dataset"), seed=0)
    assert time.perf_counter() - start < 5.0


def test_missing_local_path_and_unknown_builtin_are_reported_plainly():
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(DataConfig(source="./no/such/file.jsonl"), seed=0)
    with pytest.raises(DataError, match="builtin:pydoc_topics"):
        load_corpus(DataConfig(source="builtin:shakespeare"), seed=0)


def test_empty_corpus_is_a_data_error(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="holds no text"):
        load_corpus(DataConfig(source=str(tmp_path)), seed=0)


def test_single_document_is_split_by_token_position(tmp_path):
    (tmp_path / "only.txt").write_text("x" * 999)
    corpus = load_corpus(DataConfig(source=str(tmp_path / "only.txt"), eval_fraction=0.1), seed=0)
    assert (_tokens(corpus.train).numel(), _tokens(corpus.eval).numel()) == (900, 100)


def test_config_problems_are_all_reported_at_once():
    cfg = DataConfig(eval_fraction=0.7, max_bytes=-1, format="csv")  # type: ignore[arg-type]
    assert len(cfg.problems()) == 3
    with pytest.raises(DataError, match="eval_fraction.*max_bytes"):
        load_corpus(cfg, seed=0)


# --- token stream ----------------------------------------------------------------------------


def _arange_stream(n: int) -> TokenStream:
    return TokenStream(_array(torch.arange(n, dtype=torch.int32)))


def test_stream_batches_are_contiguous_shifted_windows():
    stream = _arange_stream(100)
    inputs_BT, targets_BT = stream.next_batch(batch_size=3, seq_len=4)
    assert inputs_BT.dtype == torch.int64 and inputs_BT.shape == (3, 4)
    assert inputs_BT.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert torch.equal(targets_BT, inputs_BT + 1)
    inputs_BT, _ = stream.next_batch(batch_size=2, seq_len=5)
    assert inputs_BT[0, 0] == 12 and stream.state_dict()["cursor"] == 22 and stream.state_dict()["epoch"] == 0


@settings(max_examples=30 * EXPLORE_FACTOR, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 9)), min_size=1, max_size=12),
    resume_at=st.integers(0, 12),
)
def test_resumed_stream_reproduces_the_uninterrupted_batches_across_shape_changes(shapes, resume_at):
    tokens = torch.randint(0, 257, (61,), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    tokens = _array(tokens)
    full = TokenStream(tokens)
    expected = [full.next_batch(b, t) for b, t in shapes]

    first = TokenStream(tokens)
    resume_at = min(resume_at, len(shapes))
    for b, t in shapes[:resume_at]:
        first.next_batch(b, t)
    state = json.loads(json.dumps(first.state_dict()))  # must survive a round trip through a checkpoint
    resumed = TokenStream(tokens)
    resumed.load_state_dict(state)
    for (b, t), (want_x, want_y) in zip(shapes[resume_at:], expected[resume_at:]):
        got_x, got_y = resumed.next_batch(b, t)
        assert torch.equal(got_x, want_x) and torch.equal(got_y, want_y)
    assert resumed.state_dict() == full.state_dict()


def test_stream_wraps_to_the_start_and_counts_the_epoch():
    stream = _arange_stream(25)
    stream.next_batch(2, 5)
    stream.next_batch(2, 5)  # cursor 20: another 2x5 batch needs tokens up to 30
    assert (stream.cursor, stream.epoch) == (20, 0)
    inputs_BT, _ = stream.next_batch(2, 5)
    assert inputs_BT[0, 0] == 0 and (stream.cursor, stream.epoch) == (10, 1)
    assert stream.tokens_consumed == 25 + 10


def test_too_short_stream_says_how_many_tokens_a_batch_needs():
    with pytest.raises(DataError, match=r"has 20 tokens, but one batch of 4 x 5 needs 21"):
        _arange_stream(20).next_batch(4, 5)


def test_loading_a_position_beyond_the_stream_is_refused():
    with pytest.raises(DataError, match="does not fit a stream of 10 tokens"):
        _arange_stream(10).load_state_dict({"cursor": 11, "epoch": 0})


# --- eval batches ----------------------------------------------------------------------------


def test_eval_batches_are_deterministic_non_overlapping_full_batches():
    tokens = _array(torch.arange(100, dtype=torch.int32))
    batches = eval_batches(tokens, batch_size=2, seq_len=8, max_batches=4)
    assert len(batches) == 4
    starts = [int(x[r, 0]) for x, _ in batches for r in range(2)]
    assert starts == list(range(0, 64, 8))
    for x, y in batches:
        assert x.dtype == torch.int64 and x.shape == (2, 8) and torch.equal(y, x + 1)
    again = eval_batches(tokens, batch_size=2, seq_len=8, max_batches=4)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(batches, again))
    assert len(eval_batches(tokens, batch_size=2, seq_len=8, max_batches=100)) == 6  # 12 rows fit


def test_eval_batches_shrink_to_the_rows_that_fit_and_refuse_less_than_one_row():
    tokens = _array(torch.arange(30, dtype=torch.int32))
    (only,) = eval_batches(tokens, batch_size=8, seq_len=9, max_batches=5)
    assert only[0].shape == (3, 9)  # 3 rows of 9 need 28 tokens
    with pytest.raises(DataError, match="fewer than one window"):
        eval_batches(tokens, batch_size=8, seq_len=30, max_batches=5)
