"""`growtrain export-hf`: exported folders load in transformers from a process where growtrain is
not importable (tests/hf_load_worker.py) and compute what growtrain computes: logits, greedy
generation with and without transformers' cache, the tokenizer. Checkpoint kinds: a real CLI run
(growth history, balance bias), dense, MoE softmax and sigmoid with shared expert and balance bias,
NF4 + LoRA merged, peft dense LoRA merged, expert-parallel shard files; float32 and bfloat16;
sharded safetensors; rows streamed in small chunks."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import growtrain.hf.common as hf_common
import growtrain.hf.export as hf_export
from conftest import MICRO, REPO, cli_env, run_cli
from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager, file_entry, read_meta, shard_file_name, write_shard_file
from growtrain.cli import main
from growtrain.model.expert_shards import is_expert_tensor, slice_state
from growtrain.generate import sample
from growtrain.hf.export import export_hf
from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.model.config import DenseLoRAConfig, ExpertLoRAConfig
from growtrain.recipe import to_plain
from growtrain.data.tokenizer import CHECKPOINT_TOKENIZER, ByteTokenizer, HFTokenizerFile, tokenizer_identity

pytest.importorskip("transformers")
pytest.importorskip("bitsandbytes")

V = 257  # the byte tokenizer's vocabulary
CONTEXT = 128
NEW_TOKENS = 50
TEXTS = ["The quick brown fox.", "héllo wörld € 日本", "  two  spaces\tand a tab\nnew line ", ""]


def _config(**moe_changes) -> ModelConfig:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=64, router_init_std=0.5, lora=ExpertLoRAConfig(r=4, lora_alpha=8.0))
    moe = MoEConfig(**{**to_plain(moe), "lora": moe.lora, **moe_changes})
    return ModelConfig(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, init_std=0.08, moe=moe, moe_layers=(0, 1))


def _model(cfg: ModelConfig, seed: int) -> GrowLM:
    torch.manual_seed(seed)
    model = GrowLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # nonzero adapters: merging them must matter
                p.normal_(0.0, 0.05)
        for layer in model.moe_layers:  # a balance bias that changes the selection
            layer.router.balance_bias.copy_(torch.randn(layer.num_experts) * 0.05)
    return model.eval()


VARIANTS = {
    "dense": lambda: _model(ModelConfig(vocab_size=V, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, init_std=0.08), 1),
    "moe_softmax": lambda: _model(_config(), 2),
    "moe_sigmoid_shared": lambda: _model(_config(score_func="sigmoid", shared_expert_hidden=32, balance_bias_rate=0.01).with_changes(moe_layers=(1,)), 3),
    "nf4_lora": lambda: _model(_config(expert_format="nf4"), 4),
    "dense_lora": lambda: _model(_config().with_changes(dense_lora=DenseLoRAConfig(r=4, lora_alpha=8.0, target_modules=("wq", "wv", "w_gate"))), 5),
    "nf4_ep2": lambda: _model(_config(expert_format="nf4"), 6),
    # a run whose data.tokenizer is a tokenizer.json (BPE, 300 tokens): its copy goes with the export
    "bpe": lambda: _model(ModelConfig(vocab_size=BPE_VOCAB, d_model=64, n_layers=2, n_heads=4, ffn_hidden=96, init_std=0.08), 7),
}
BPE_VOCAB = 300


def _bpe_tokenizer(path: Path) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=["<|endoftext|>"], initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))], trainer)
    tok.save(str(path))
    return path


def _meta(template: dict, model: GrowLM) -> dict:
    meta = copy.deepcopy(template)
    meta.update(model_config=to_plain(model.config), stage=0, growth_history=[], params_total=model.num_parameters())
    meta.pop("expert_parallel", None)
    meta["recipe"]["stages"][0]["seq_len"] = CONTEXT
    return meta


def _save(run_dir: Path, model: GrowLM, meta: dict, ep: int = 1, tokenizer: Path | None = None) -> None:
    """A checkpoint as the trainer writes it: one process, or `ep` ranks' expert shard files; with
    `tokenizer`, a tokenizer.json run: its copy in the checkpoint, its identity in meta.json."""
    manager = CheckpointManager(run_dir, CheckpointConfig(), log=lambda s: None)
    state = model.state_dict()
    if ep == 1:
        extra = {}
        if tokenizer is not None:
            meta["recipe"]["data"]["tokenizer"] = str(tokenizer)
            meta["tokenizer"] = tokenizer_identity(str(tokenizer))
            extra = {CHECKPOINT_TOKENIZER: tokenizer.read_text()}
        manager.save(7, model_state=state, trainer_state={"optimizer": {}}, meta=meta, extra_files=extra)
        return
    experts = {n: t for n, t in state.items() if is_expert_tensor(n)}
    meta = {**meta, "expert_parallel": {"size": ep, "files": [shard_file_name(r, ep) for r in range(ep)]}}

    def write_shards(tmp: Path) -> dict:
        entries = {}
        for r in range(ep):
            name = shard_file_name(r, ep)
            write_shard_file(tmp / name, {"ep_rank": r, "ep_size": ep, "model": slice_state(experts, r, ep), "optimizer": {}})
            entries[name] = file_entry(tmp / name)
        return entries

    dense = {n: t for n, t in state.items() if not is_expert_tensor(n)}
    manager.save(7, model_state=dense, trainer_state={"optimizer": {}}, meta=meta, write_shards=write_shards)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Every variant checkpointed and exported, the real run through the CLI, and what the
    worker read back from transformers. Returns (references, worker results, paths)."""
    root = tmp_path_factory.mktemp("export_hf")
    recipe = root / "micro.yaml"
    import yaml

    recipe.write_text(yaml.safe_dump(MICRO, sort_keys=False))
    done = run_cli("run", recipe, "--out", root / "run")
    assert done.returncode == 0, done.stderr[-2000:]
    done = run_cli("export-hf", root / "run", "--out", root / "out" / "run")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exported" in done.stdout and "from_pretrained" in done.stdout
    template = read_meta(root / "run" / "checkpoints" / "step-00000020")

    gen = torch.Generator().manual_seed(0)
    jobs, refs = [], {}
    for name, build in VARIANTS.items():
        model = build()
        tokenizer = _bpe_tokenizer(root / "bpe-tokenizer.json") if name == "bpe" else None
        _save(root / name, model, _meta(template, model), ep=2 if name.endswith("ep2") else 1, tokenizer=tokenizer)
        out = root / "out" / name
        if name == "nf4_ep2":  # rows streamed in many small chunks, across the shard files' boundaries
            chunk, hf_common.CHUNK_BYTES = hf_common.CHUNK_BYTES, 3000
            try:
                export_hf(root / name, out, log=lambda s: None)
            finally:
                hf_common.CHUNK_BYTES = chunk
        else:
            export_hf(root / name, out, max_shard_size="60KB" if name == "moe_softmax" else "5GB", log=lambda s: None)
        tokens = torch.randint(0, V - 1, (2, 24), generator=gen)
        prompt = ByteTokenizer().encode("The ")
        with torch.no_grad():
            logits = model(tokens).logits
        greedy = sample(model, prompt, NEW_TOKENS, 0.0, 0, torch.Generator(), CONTEXT)
        refs[name] = {"logits": logits, "generate": greedy, "model": model}
        jobs.append({"dir": str(out), "dtype": "float32", "tokens": tokens.tolist(), "prompt": prompt, "new_tokens": NEW_TOKENS})
    # bfloat16: the sigmoid + shared-expert model again (jobs[2])
    export_hf(root / "moe_sigmoid_shared", root / "out" / "bf16", dtype="bfloat16", log=lambda s: None)
    jobs.append({**jobs[2], "dir": str(root / "out" / "bf16"), "dtype": "bfloat16"})
    refs["bf16"] = refs["moe_sigmoid_shared"]
    # the CLI run: its own trained model (context 48: prompt and continuation stay inside it)
    from growtrain.checkpoint.store import resolve
    from growtrain.generate import load_model

    run_model = load_model(resolve(root / "run", log=lambda s: None))
    tokens = torch.randint(0, V - 1, (2, 24), generator=gen)
    prompt = ByteTokenizer().encode("def ")
    with torch.no_grad():
        refs["run"] = {"logits": run_model(tokens).logits, "generate": sample(run_model, prompt, 40, 0.0, 0, torch.Generator(), 48), "model": run_model}
    jobs.append({"dir": str(root / "out" / "run"), "dtype": "float32", "tokens": tokens.tolist(), "prompt": prompt, "new_tokens": 40})

    (root / "job.json").write_text(json.dumps({"exports": jobs, "texts": TEXTS}))
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(root / "hf_modules"), TRANSFORMERS_VERBOSITY="error")
    worker = subprocess.run(
        [sys.executable, "-I", str(REPO / "tests" / "hf_load_worker.py"), str(root / "job.json"), str(root / "results.pt")],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )
    assert worker.returncode == 0, worker.stderr[-3000:]
    results = torch.load(root / "results.pt", weights_only=False)
    names = list(VARIANTS) + ["bf16", "run"]
    return refs, dict(zip(names, results)), root


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item() / want.abs().max().item()


@pytest.mark.parametrize("name", list(VARIANTS) + ["run"])
def test_exported_model_gives_growtrains_logits_in_transformers_without_growtrain(exported, name):
    refs, results, _ = exported
    # growtrain could not be imported; nor were peft or bitsandbytes (what transformers itself
    # imports where installed, accelerate and triton, is its own business).
    assert not {"growtrain", "peft", "bitsandbytes"} & set(results[name]["modules"])
    assert _rel(results[name]["logits"], refs[name]["logits"]) < 1e-5


def test_nonzero_adapters_and_balance_bias_matter_so_the_logit_check_can_fail(exported):
    refs, _, _ = exported
    for name in ("nf4_lora", "dense_lora", "moe_sigmoid_shared"):
        model = refs[name]["model"]
        tokens = torch.randint(0, V - 1, (2, 24), generator=torch.Generator().manual_seed(1))
        plain = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in plain.named_parameters():
                if "lora_B" in n:
                    p.zero_()
            for layer in plain.moe_layers:
                layer.router.balance_bias.zero_()
            assert _rel(plain(tokens).logits, model(tokens).logits) > 1e-3, name


@pytest.mark.parametrize("name", list(VARIANTS) + ["run"])
def test_greedy_generate_with_the_cache_equals_without_it_and_growtrains_generate(exported, name):
    refs, results, _ = exported
    got, uncached, want = results[name]["generate_cached"], results[name]["generate_uncached"], refs[name]["generate"]
    assert got == uncached
    if name != "run":  # the micro run, 20 steps trained, continues with spaces; the random models vary
        assert len(set(want[-20:])) > 2, "a degenerate continuation would prove little"
    # transformers stops at the EOS (generation_config.json); growtrain's sampler does not.
    assert got == want[: len(got)] and (len(got) == len(want) or got[-1] == ByteTokenizer.eos_id)


def test_autotokenizer_encodes_and_decodes_like_the_byte_tokenizer(exported):
    _, results, _ = exported
    r = results["dense"]
    assert r["encoded"] == [ByteTokenizer().encode(t) for t in TEXTS]
    assert r["plain_tokenizer_encoded"] == r["encoded"]
    assert r["decoded"] == TEXTS


def test_a_tokenizer_file_exports_with_its_eos_and_autotokenizer_encodes_as_growtrain(exported):
    _, results, root = exported
    ours = HFTokenizerFile(root / "bpe" / "checkpoints" / "step-00000007" / CHECKPOINT_TOKENIZER)
    r = results["bpe"]
    assert r["encoded"] == [ours.encode(t) for t in TEXTS]
    assert r["decoded"] == [ours.decode(ours.encode(t)) for t in TEXTS]
    assert any(len(ids) < len(t.encode()) for ids, t in zip(r["encoded"], TEXTS)), "the BPE must merge something"
    config = json.loads((root / "out" / "bpe" / "tokenizer_config.json").read_text())
    assert config["eos_token"] == "<|endoftext|>" and json.loads((root / "out" / "bpe" / "config.json").read_text())["eos_token_id"] == ours.eos_id


def test_bfloat16_export_is_within_bfloat16_rounding_and_keeps_the_router_in_float32(exported):
    refs, results, root = exported
    assert results["bf16"]["router_dtype"] == "torch.float32"
    with safe_open(str(root / "out" / "bf16" / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert {d for k, d in dtypes.items() if ".router." in k} == {"F32"}
    assert {d for k, d in dtypes.items() if ".router." not in k} == {"BF16"}
    err = _rel(results["bf16"]["logits"], refs["bf16"]["logits"])
    # bfloat16 keeps 8 significant bits (relative rounding 2^-9 per operation); over two blocks of
    # norms, projections and experts the measured error is 7e-3 of the largest logit.
    assert 1e-4 < err < 5e-2, err


def test_small_max_shard_size_writes_an_index_transformers_follows(exported):
    _, _, root = exported
    out = root / "out" / "moe_softmax"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    assert index["metadata"]["total_size"] == sum(
        math.prod(f.get_slice(k).get_shape()) * 4 for name in files for f in [safe_open(str(out / name), "pt")] for k in f.keys()
    )


def test_export_folder_holds_config_remote_code_tokenizer_and_a_model_card(exported):
    _, _, root = exported
    out = root / "out" / "run"
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "growlm" and config["architectures"] == ["GrowLMForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_growlm.GrowLMForCausalLM"
    assert config["max_position_embeddings"] == 48 and config["eos_token_id"] == 256
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    card = (out / "README.md").read_text()
    assert "upcycle_moe" in card and "deepen" in card and "trust_remote_code=True" in card
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "a temporary folder was left behind"


def test_export_hf_reports_user_mistakes_without_a_traceback(exported, tmp_path, capsys):
    _, _, root = exported
    assert main(["export-hf", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    assert "no such file" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    assert main(["export-hf", str(root / "dense"), "--out", str(busy)]) == 2
    assert "--overwrite" in capsys.readouterr().err and (busy / "keep.txt").read_text() == "mine"
    assert main(["export-hf", str(root / "nf4_lora"), "--out", str(tmp_path / "q"), "--experts", "nf4"]) == 2
    assert "cannot be honoured" in capsys.readouterr().err and not (tmp_path / "q").exists()
    assert main(["export-hf", str(root / "dense"), "--out", str(tmp_path / "s"), "--max-shard-size", "lots"]) == 2
    assert "--max-shard-size" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["export-hf", str(root / "dense"), "--out", str(tmp_path / "file" / "sub")]) == 2
    assert "traceback" not in capsys.readouterr().err.lower()


def test_a_damaged_checkpoint_is_named_and_a_run_directory_falls_back_to_an_intact_one(exported, tmp_path, capsys):
    _, _, root = exported
    import shutil

    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    newest = sorted((run / "checkpoints").glob("step-*"))[-1]
    with open(newest / "model.safetensors", "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    assert main(["export-hf", str(newest), "--out", str(tmp_path / "a")]) == 2
    assert "damaged" in capsys.readouterr().err and not (tmp_path / "a").exists()
    assert main(["export-hf", str(run), "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr()
    assert "falling back" in out.out + out.err and (tmp_path / "b" / "config.json").is_file()


def test_overwrite_replaces_the_folder_only_with_a_complete_export_and_a_killed_exports_leftovers_go(exported, tmp_path, monkeypatch):
    _, _, root = exported
    out = tmp_path / "o"
    (tmp_path / ".o.tmp-999999999").mkdir()  # left by an export that was killed: swept
    export_hf(root / "dense", out, log=lambda s: None)
    before = (out / "model.safetensors").read_bytes()

    def disk_full(*a, **k):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_export, "write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_hf(root / "moe_softmax", out, overwrite=True, log=lambda s: None)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


_LM_EVAL = """
import importlib.abc, sys
class NoGrowtrain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "growtrain":
            raise ModuleNotFoundError(f"growtrain must not be importable here (asked for {name})")
sys.meta_path.insert(0, NoGrowtrain())
from lm_eval.__main__ import cli_evaluate
sys.argv[0] = "lm_eval"
cli_evaluate()
"""


def test_lm_eval_offline_perplexity_of_the_export_equals_growtrains_own_loss_on_the_same_text(exported):
    """lm-evaluation-harness, offline, on the shipped evals/ tasks: its bits per byte over the first
    documents equals growtrain's own per-token loss of the same text (byte tokenizer: one token a
    byte), each document scored after the EOS as lm-eval's rolling windows do."""
    pytest.importorskip("lm_eval")
    refs, _, root = exported
    limit = 4
    out = root / "lm_eval"
    env = {k: v for k, v in cli_env().items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(root / "hf_modules"), TRANSFORMERS_VERBOSITY="error")
    # max_length above every document: one window per document, so the scoring is lm-eval's full-context one.
    done = subprocess.run(
        [sys.executable, "-I", "-c", _LM_EVAL, "--model", "hf", "--model_args",
         f"pretrained={root / 'out' / 'run'},trust_remote_code=True,dtype=float32,max_length=1024",
         "--include_path", str(REPO / "evals"), "--tasks", "growtrain_heldout_ppl,growtrain_facts_mc",
         "--device", "cpu", "--batch_size", "1", "--limit", str(limit), "--output_path", str(out)],
        cwd=root, env=env, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    (results_file,) = out.rglob("results_*.json")
    results = json.loads(results_file.read_text())["results"]
    bits_per_byte = results["growtrain_heldout_ppl"]["bits_per_byte,none"]
    assert 0.0 <= results["growtrain_facts_mc"]["acc,none"] <= 1.0

    model, tok = refs["run"]["model"], ByteTokenizer()
    docs = [json.loads(line)["text"] for line in (REPO / "evals" / "data" / "heldout.jsonl").read_text().splitlines()[:limit]]
    nll, count = 0.0, 0
    with torch.no_grad():
        for text in docs:
            ids = tok.encode(text)
            logits = model(torch.tensor([[tok.eos_id] + ids[:-1]])).logits[0].double()
            nll += torch.nn.functional.cross_entropy(logits, torch.tensor(ids), reduction="sum").item()
            count += len(ids)
    ours = nll / count
    theirs = bits_per_byte * math.log(2)
    assert abs(theirs - ours) / ours < 1e-4, (theirs, ours)


def assert_export_holds_the_checkpoints_weights(run_dir: Path, out: Path) -> int:
    """Export `run_dir` (a trainer's checkpoint of full-precision experts) and compare every
    exported tensor with the model growtrain itself assembles from that checkpoint: bitwise equal,
    none missing, none extra. Used on real expert-parallel and AF runs (their own test files)."""
    from growtrain.checkpoint.store import resolve

    export_hf(run_dir, out, log=lambda s: None)
    want = {hf_export.hf_name(n): t for n, t in resolve(run_dir, log=lambda s: None).model_state.items()}
    files = [out / "model.safetensors"] if (out / "model.safetensors").is_file() else sorted(out.glob("model-*.safetensors"))
    got = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert torch.equal(got[name], t), name
    return len(got)


def test_the_exported_byte_tokenizer_matches_growtrains_on_random_ids_and_text_invalid_utf8_included():
    """The tokenizers file `export-hf` writes for the byte tokenizer, against ByteTokenizer itself:
    random id sequences (cut multi-byte characters, stray continuation bytes, EOS) decode alike
    (both replace invalid UTF-8 the same way), random text encodes alike."""
    import random

    from tokenizers import Tokenizer

    exported, ours = Tokenizer.from_str(hf_export.byte_tokenizer_json()), ByteTokenizer()
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.choice([rng.randrange(256), rng.randrange(128), 0xC3, 0xE2, 0x82, 0xAC, 0xF0, 256]) for _ in range(rng.randrange(1, 12))]
        assert exported.decode(ids, skip_special_tokens=True) == ours.decode(ids), ids
        text = "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x800), rng.randrange(0x800, 0xD800), rng.randrange(0x10000, 0x10FFFF), 10, 9])) for _ in range(rng.randrange(0, 10)))
        assert exported.encode(text, add_special_tokens=False).ids == ours.encode(text), text
