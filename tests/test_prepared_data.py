"""Prepared data (`growtrain prepare-data`, growtrain/data/prepare.py and growtrain/data/shards.py): token shards equal
what reading the source at start gives, training on them equals training on the source, resume and
EP = 2 on them equal the uninterrupted single-process run, each rank reads only its rows, and every
bad input exits 2 with a message saying what and where."""

from __future__ import annotations

import json
import signal
import subprocess

import numpy as np
import pytest
import yaml

from conftest import MICRO, assert_same_run, cli_env, losses, run_cli, train_recipe
from growtrain.data.corpus import DataConfig, DataError, TokenArray, TokenStream, eval_batches, load_corpus
from growtrain.data.prepare import PrepareOptions, prepare_data
from growtrain.data.shards import IN_PROGRESS, MANIFEST, read_manifest

# The micro recipe's data, prepared with its seed: one buffer, so the same tokens as reading it.
MICRO_DATA = MICRO["data"]
MICRO_PREPARE = ["--max-bytes", MICRO_DATA["max_bytes"], "--eval-fraction", MICRO_DATA["eval_fraction"], "--seed", MICRO["seed"]]


def _all(array: TokenArray) -> np.ndarray:
    return array.read(0, len(array))


def _prepare_cli(source, out, *extra, env=None) -> subprocess.CompletedProcess:
    return run_cli("prepare-data", source, "--out", out, *extra, env=env)


@pytest.fixture(scope="module")
def micro_prepared(tmp_path_factory):
    """The micro recipe's corpus, prepared through the CLI into shards of 20,000 tokens."""
    out = tmp_path_factory.mktemp("prepared") / "micro"
    r = _prepare_cli(MICRO_DATA["source"], out, *MICRO_PREPARE, "--shard-tokens", 20_000, "--workers", 2)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


# --------------------------------------------------------------------------- the shards themselves


def test_prepared_shards_hold_exactly_the_tokens_reading_the_source_gives(micro_prepared):
    memory = load_corpus(DataConfig(**MICRO_DATA), seed=MICRO["seed"])
    prepared = load_corpus(DataConfig(source=str(micro_prepared), eval_fraction=MICRO_DATA["eval_fraction"]), seed=MICRO["seed"])
    manifest = read_manifest(micro_prepared)
    assert manifest.dtype == "uint16" and len(manifest.train) > 3, "several shards, so windows cross shard ends"
    assert all(isinstance(p, np.memmap) for p in prepared.train.parts), "training maps the shards, never loads them"
    assert np.array_equal(_all(prepared.train), _all(memory.train))
    assert np.array_equal(_all(prepared.eval), _all(memory.eval))
    assert prepared.fingerprint == manifest.fingerprint != memory.fingerprint
    assert "memory-mapped" in prepared.description


def test_a_source_streamed_through_small_buffers_keeps_the_held_out_set_and_every_train_document(tmp_path):
    cfg = DataConfig(source="builtin:pydoc_topics", eval_fraction=0.1)
    out = tmp_path / "streamed"
    prepare_data(PrepareOptions(source=cfg.source, out=out, eval_fraction=0.1, buffer_bytes=50_000, workers=1, shard_tokens=30_000))
    memory = load_corpus(cfg, seed=0)
    prepared = load_corpus(DataConfig(source=str(out), eval_fraction=0.1), seed=0)
    eos = memory.tokenizer.eos_id
    # The hash split does not depend on the buffers: the held-out tokens are identical.
    assert np.array_equal(_all(prepared.eval), _all(memory.eval))
    # The train documents are the same ones, shuffled within each buffer instead of all together.
    def documents(tokens):
        return sorted(bytes(d.astype(np.uint8)) for d in np.split(tokens, np.flatnonzero(tokens == eos) + 1) if len(d))

    got, want = _all(prepared.train), _all(memory.train)
    assert not np.array_equal(got, want)
    assert documents(got) == documents(want)


def test_a_tokenizer_file_is_used_by_the_workers_and_copied_next_to_the_shards(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<unk>", "<|endoftext|>", *sorted({w for w in "the quick brown fox jumps over the lazy dog again and again".split()})]
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "docs"
    src.mkdir()
    for i in range(40):
        (src / f"{i:02d}.txt").write_text(" ".join(words[2 + (i + j) % (len(words) - 2)] for j in range(30)))
    out = tmp_path / "out"
    r = _prepare_cli(src, out, "--tokenizer", tmp_path / "tokenizer.json", "--workers", 2, "--eval-fraction", 0.2)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"data.tokenizer={out}" in r.stdout, "the hint names the copy, which a recipe can use"
    cfg = DataConfig(source=str(src), tokenizer=str(tmp_path / "tokenizer.json"), eval_fraction=0.2)
    memory = load_corpus(cfg, seed=0)
    prepared = load_corpus(DataConfig(source=str(out), tokenizer=str(out), eval_fraction=0.2), seed=0)
    assert np.array_equal(_all(prepared.train), _all(memory.train)) and np.array_equal(_all(prepared.eval), _all(memory.eval))


def test_check_data_passes_intact_shards_and_names_a_changed_one(micro_prepared, tmp_path):
    ok = run_cli("check-data", micro_prepared)
    assert ok.returncode == 0 and "match the manifest" in ok.stdout
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(micro_prepared, copy)
    shard = copy / "train-00001.bin"
    raw = bytearray(shard.read_bytes())
    raw[100] ^= 1
    shard.write_bytes(bytes(raw))
    bad = run_cli("check-data", copy)
    assert bad.returncode == 2 and "train-00001.bin: sha256" in bad.stderr


# --------------------------------------------------------------------------- the stream


class _RecordingPart:
    """A shard that records which token ranges are read from it."""

    def __init__(self, tokens: np.ndarray, reads: list):
        self.tokens, self.reads = tokens, reads

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, s: slice) -> np.ndarray:
        self.reads.append((id(self), s.start, s.stop))
        return self.tokens[s]


def test_each_rank_reads_only_its_rows_and_the_ranks_together_read_the_batch():
    tokens = np.arange(1000, dtype=np.int32)
    full = TokenStream(TokenArray([tokens[:300], tokens[300:]]))
    reads: list = []
    parts = [_RecordingPart(tokens[:300], reads), _RecordingPart(tokens[300:], reads)]
    ranks = [TokenStream(TokenArray(parts)) for _ in range(4)]
    for _ in range(5):
        want_x, want_y = full.next_batch(8, 9)
        got = []
        for r, stream in enumerate(ranks):
            reads.clear()
            x, y = stream.next_batch(8, 9, rows=(2 * r, 2 * r + 2))
            n_read = sum(stop - start for _, start, stop in reads)
            assert n_read == 2 * 9 + 1, f"rank {r} read {n_read} tokens for its 2 rows of 9"
            got.append((x, y))
        assert np.array_equal(np.concatenate([x for x, _ in got]), want_x)
        assert np.array_equal(np.concatenate([y for _, y in got]), want_y)
    assert all(s.state_dict() == full.state_dict() for s in ranks)


def test_later_epochs_read_the_shards_in_a_seeded_order_and_a_resume_mid_epoch_repeats_it():
    parts = [np.full(40, i, dtype=np.int32) for i in range(6)]
    stream = TokenStream(TokenArray(parts, [f"s{i}" for i in range(6)]), shuffle_seed=5)

    def epoch_shards(s: TokenStream) -> list[int]:
        # Batches of 40 (+1 target) tokens: one per shard; the sixth would need a token past the
        # end, so five batches make an epoch, the first five shards of its order.
        return [int(s.next_batch(1, 40)[0][0, 0]) for _ in range(5)]

    first = epoch_shards(stream)
    assert first == list(range(5)), "epoch 0 reads the shards in the manifest's order"
    second = epoch_shards(stream)
    assert len(set(second)) == 5 and second != first
    state = json.loads(json.dumps(stream.state_dict()))
    assert state["epoch"] == 1 and state["shuffle_seed"] == 5
    third = epoch_shards(stream)
    resumed = TokenStream(TokenArray(parts, [f"s{i}" for i in range(6)]), shuffle_seed=5)
    resumed.load_state_dict(state)
    assert epoch_shards(resumed) == third != second
    other_seed = TokenStream(TokenArray(parts), shuffle_seed=6)
    with pytest.raises(DataError, match="shuffled with seed 5"):
        other_seed.load_state_dict(state)


def test_eval_rows_of_every_rank_make_the_whole_eval_batch():
    tokens = TokenArray([np.arange(500, dtype=np.int32)])
    whole = eval_batches(tokens, 4, 10, 3)
    halves = [eval_batches(tokens, 4, 10, 3, rows=(2 * r, 2 * r + 2)) for r in range(2)]
    for b, (x, y) in enumerate(whole):
        assert np.array_equal(np.concatenate([halves[0][b][0], halves[1][b][0]]), x)
        assert np.array_equal(np.concatenate([halves[0][b][1], halves[1][b][1]]), y)


# --------------------------------------------------------------------------- training on it


@pytest.fixture(scope="module")
def micro_memory_run(tmp_path_factory):
    _, out, _ = train_recipe(MICRO, tmp_path_factory.mktemp("memory"), "micro")
    return out


def _prepared_recipe(prepared, changes: dict | None = None) -> dict:
    raw = json.loads(json.dumps(MICRO))
    raw["data"] = {"source": str(prepared), "eval_fraction": MICRO_DATA["eval_fraction"]}
    raw.update(changes or {})
    return raw


@pytest.mark.slow
def test_training_on_prepared_data_repeats_the_run_that_read_the_source(micro_prepared, micro_memory_run, tmp_path):
    _, out, done = train_recipe(_prepared_recipe(micro_prepared), tmp_path, "prepared")
    assert "memory-mapped" in done.stdout
    assert losses(out) == losses(micro_memory_run), "same tokens, same batches: the same losses bit for bit"


@pytest.mark.slow
def test_killed_and_resumed_on_prepared_data_repeats_the_uninterrupted_run(micro_prepared, micro_memory_run, tmp_path):
    recipe = tmp_path / "prepared.yaml"
    recipe.write_text(yaml.safe_dump(_prepared_recipe(micro_prepared), sort_keys=False))
    out = tmp_path / "run"
    killed = run_cli("run", recipe, "--out", out, env=cli_env(GROWTRAIN_FAULT="step_mid:11"))
    assert killed.returncode == -signal.SIGKILL
    resumed = run_cli("run", recipe, "--out", out)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    assert_same_run(out, micro_memory_run, 20)
    meta = json.loads(next(iter(sorted((out / "checkpoints").glob("step-*/meta.json")))).read_text())
    assert meta["data_fingerprint"] == read_manifest(micro_prepared).fingerprint
    shown = run_cli("inspect", out)
    position = json.loads(run_cli("inspect", out, "--json").stdout)["data_position"]
    assert position["shard"].startswith("train-") and position["cursor"] > 0 and position["epoch"] == 0
    assert f"{position['shard']} at token {position['offset']:,}" in shown.stdout


@pytest.mark.slow
def test_expert_parallel_on_prepared_data_equals_one_process_reading_the_source(tmp_path):
    from test_expert_parallel import EP_RECIPE, STEPS, assert_close_losses, growtrain_torchrun

    prepared = tmp_path / "ep-data"
    data = EP_RECIPE["data"]
    r = _prepare_cli(data["source"], prepared, "--max-bytes", data["max_bytes"], "--eval-fraction", data["eval_fraction"],
                     "--seed", EP_RECIPE["seed"], "--shard-tokens", 30_000)
    assert r.returncode == 0, r.stderr[-2000:]
    (tmp_path / "one").mkdir()
    _, single, _ = train_recipe(EP_RECIPE, tmp_path / "one", "ep")
    raw = json.loads(json.dumps(EP_RECIPE))
    raw["data"] = {"source": str(prepared), "eval_fraction": data["eval_fraction"]}
    recipe = tmp_path / "ep-prepared.yaml"
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    run = growtrain_torchrun(2, "run", recipe, "--out", tmp_path / "ep2")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert_close_losses(losses(tmp_path / "ep2"), losses(single), f"EP=2 on prepared data ({STEPS} steps)")


# --------------------------------------------------------------------------- bad input, interrupted prepares


def _train_error(tmp_path, prepared, changes: dict | None = None) -> subprocess.CompletedProcess:
    recipe = tmp_path / "bad.yaml"
    raw = _prepared_recipe(prepared, changes)
    raw["stages"] = raw["stages"][:1]
    recipe.write_text(yaml.safe_dump(raw, sort_keys=False))
    return run_cli("run", recipe, "--out", tmp_path / "run")


@pytest.fixture
def prepared_copy(micro_prepared, tmp_path):
    import shutil

    copy = tmp_path / "data"
    shutil.copytree(micro_prepared, copy)
    return copy


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_training_on_a_missing_or_truncated_shard_exits_2_naming_it(prepared_copy, tmp_path, damage):
    shard = prepared_copy / "train-00002.bin"
    if damage == "missing":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-2])
    r = _train_error(tmp_path, prepared_copy)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "train-00002.bin" in r.stderr and ("missing" in r.stderr if damage == "missing" else "truncated" in r.stderr)
    assert "Traceback" not in r.stderr


def test_training_with_another_tokenizer_than_the_shards_were_written_with_exits_2(prepared_copy, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0, "</s>": 1, "a": 2}, unk_token="<unk>"))
    hf.save(str(tmp_path / "tokenizer.json"))
    r = _train_error(tmp_path, prepared_copy, {"data": {"source": str(prepared_copy), "tokenizer": str(tmp_path / "tokenizer.json")}})
    assert r.returncode == 2 and "was prepared with the byte tokenizer" in r.stderr, r.stderr[-2000:]


def test_a_vocabulary_too_large_for_uint16_shards_exits_2(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")).save(str(tmp_path / "big.json"))
    r = _prepare_cli("builtin:pydoc_topics", tmp_path / "out", "--tokenizer", tmp_path / "big.json", "--dtype", "uint16")
    assert r.returncode == 2 and "70,002 ids does not fit uint16" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_an_empty_source_exits_2_and_leaves_no_folder(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    r = _prepare_cli(tmp_path / "empty.txt", tmp_path / "out")
    assert r.returncode == 2 and "holds no text" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_prepare_refuses_a_folder_of_other_files_and_prepared_data_unless_overwrite(micro_prepared, tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    r = _prepare_cli("builtin:pydoc_topics", foreign, "--max-bytes", 50_000)
    assert r.returncode == 2 and "did not write (notes.txt)" in r.stderr
    assert (foreign / "notes.txt").read_text() == "keep me"
    out = tmp_path / "again"
    assert _prepare_cli("builtin:pydoc_topics", out, "--max-bytes", 50_000).returncode == 0
    refused = _prepare_cli("builtin:pydoc_topics", out, "--max-bytes", 60_000)
    assert refused.returncode == 2 and "already holds prepared data" in refused.stderr and "--overwrite" in refused.stderr
    replaced = _prepare_cli("builtin:pydoc_topics", out, "--max-bytes", 60_000, "--overwrite", "--shard-tokens", 7_000)
    assert replaced.returncode == 0
    manifest = read_manifest(out)
    assert manifest.settings["max_bytes"] == 60_000 and {s.tokens for s in manifest.train[:-1]} == {7_000}
    assert sorted(p.name for p in out.glob("*.bin")) == sorted(s.name for s in manifest.train + manifest.eval)


def test_a_prepare_killed_mid_write_leaves_no_manifest_and_the_next_one_starts_over(tmp_path):
    out = tmp_path / "out"
    args = ("builtin:pydoc_topics", out, "--shard-tokens", 50_000, "--workers", 1)
    killed = _prepare_cli(*args, env=cli_env(GROWTRAIN_FAULT="prepare_shard:3"))
    assert killed.returncode == -signal.SIGKILL
    assert not (out / MANIFEST).exists() and (out / IN_PROGRESS).exists()
    assert len(list(out.glob("train-*.bin"))) == 3
    # Training on it says what happened instead of reading the three shards.
    r = _train_error(tmp_path, out)
    assert r.returncode == 2 and "unfinished prepare-data" in r.stderr, r.stderr[-2000:]
    again = _prepare_cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not (out / IN_PROGRESS).exists()
    memory = load_corpus(DataConfig(), seed=0)
    prepared = load_corpus(DataConfig(source=str(out)), seed=0)
    assert np.array_equal(_all(prepared.train), _all(memory.train))
    assert run_cli("check-data", out).returncode == 0


def test_prepare_data_help_explains_the_options():
    r = run_cli("prepare-data", "--help")
    assert r.returncode == 0
    for flag in ("--out", "--tokenizer", "--eval-fraction", "--shard-tokens", "--workers", "--overwrite"):
        assert flag in r.stdout


@pytest.mark.slow
def test_the_data_memory_benchmark_prints_its_json_line():
    import sys

    from conftest import REPO

    r = subprocess.run([sys.executable, "benchmarks/data_memory.py", "--json", "--small-tokens", "2e5", "--large-tokens", "1e6",
                        "--steps", "1"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode in (0, 1), r.stderr[-3000:]  # 1: a target missed (RSS at these sizes is noise)
    line = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("rss_small_mb", "rss_large_mb", "prepare_tokens_per_s", "loader_tokens_per_s", "train_tokens_per_s"):
        assert line[key] > 0, key
    assert line["tokens_large"] > 2 * line["tokens_small"]
