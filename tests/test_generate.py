"""Generation with a KV cache (growtrain/generate.py, GrowLM.forward_cached) against the reference
that recomputes the whole context for every token (`sample_without_cache`, the old path).

What is exact and what is not, and why:
- A prefill through an empty cache runs the training forward's ops on the same operands: its
  logits are bitwise those of `model(tokens)`.
- Later positions go through other matmul shapes (one row against the cached keys), so their
  logits equal the full forward's within fp32 rounding only (tolerance below, relative to the
  largest logit); greedy token ids are then the same.
- Sampling draws from the same generator with the same logits-to-token function (`next_token`),
  so a seed reproduces a sample.

Random models with spread-out logits and router scores (std ~1 instead of 0.02), so that fp32
rounding cannot flip an argmax or a top-k choice. CPU, tiny sizes.

Legend: T tokens, V vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import subprocess
import sys

import pytest
import torch

import growtrain.generate as gen
from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager
from growtrain.cli import main
from growtrain.generate import DequantizedBases, TextStream, generate_from_checkpoint, next_token, sample, sample_without_cache, with_dequantized_bases
from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.model.config import DenseLoRAConfig, ExpertLoRAConfig
from growtrain.recipe import load_recipe, to_plain
from growtrain.data.tokenizer import ByteTokenizer
from conftest import cli_env

V = 41
REPO = Path(__file__).resolve().parents[1]
# fp32 rounding of a different summation order: measured up to 3.2e-7 of the largest logit over
# these five models and three seeds; 5e-6 leaves room and still catches a wrong position (O(1)).
FP32_REL = 5e-6


def model_config(kind: str, vocab_size: int = V) -> ModelConfig:
    base = dict(vocab_size=vocab_size, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48)
    if kind == "dense":
        return ModelConfig(**base)
    if kind == "dense_mha":  # K = H: no GQA repeat, the attention reads the cache's views directly
        return ModelConfig(**(base | {"n_kv_heads": 4}))
    if kind == "moe":
        moe = MoEConfig(num_experts=6, top_k=2, expert_hidden=24, router_init_std=0.5, shared_expert_hidden=16)
        return ModelConfig(**base, moe=moe, moe_layers=(0, 2))
    if kind == "nf4":
        moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=48, router_init_std=0.5, expert_format="nf4", lora=ExpertLoRAConfig(r=4, lora_alpha=8.0))
        return ModelConfig(**base, moe=moe, moe_layers=(1, 2))
    if kind == "nf4_dense_lora":  # peft LoRA on the attention projections, NF4 experts
        moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=48, router_init_std=0.5, expert_format="nf4", lora=ExpertLoRAConfig(r=4, lora_alpha=8.0))
        return ModelConfig(**base, moe=moe, moe_layers=(1,), dense_lora=DenseLoRAConfig(r=2, lora_alpha=4.0))
    raise ValueError(kind)


KINDS = ["dense", "dense_mha", "moe", "nf4", "nf4_dense_lora"]


def random_model(kind: str, seed: int = 0, vocab_size: int = V) -> GrowLM:
    torch.manual_seed(seed)
    model = GrowLM(model_config(kind, vocab_size))
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)  # logits std ~5: no near-ties for rounding to flip
        for name, p in model.named_parameters():
            if "lora_B" in name:  # nonzero adapters, so that they change the function
                p.normal_(0.0, 0.1)
    return model.eval()


def max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefill_through_an_empty_cache_gives_the_full_forward_logits_bit_for_bit(kind):
    model = random_model(kind)
    tokens_BT = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(tokens_BT).logits
    got = model.forward_cached(tokens_BT, model.new_cache()).logits
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.3g}"


@pytest.mark.parametrize("kind", KINDS)
def test_cached_logits_match_the_full_forward_within_fp32_rounding_at_every_later_position(kind):
    """Prefill 5 positions, then a chunk of 4 (the masked path), then one at a time (RoPE continues
    from the cache length each time); compare with one full forward over all 16 tokens."""
    model = random_model(kind, seed=2)
    tokens_BT = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want_BTV = model(tokens_BT).logits
    cache = model.new_cache(capacity=4)  # smaller than needed: the buffers must grow
    pieces = [model.forward_cached(tokens_BT[:, :5], cache).logits, model.forward_cached(tokens_BT[:, 5:9], cache).logits]
    pieces += [model.forward_cached(tokens_BT[:, t : t + 1], cache).logits for t in range(9, 16)]
    got_BTV = torch.cat(pieces, dim=1)
    assert cache.length == 16 and all(layer.length == 16 for layer in cache.layers)
    for t in range(16):
        err = max_rel(got_BTV[:, t], want_BTV[:, t])
        assert err < FP32_REL, f"position {t}: max |diff| / max |logit| = {err:.3g} (limit {FP32_REL})"


@pytest.mark.parametrize("kind", ["nf4", "nf4_dense_lora"])
def test_nf4_experts_reading_bases_dequantized_once_give_the_same_logits_bit_for_bit(kind):
    tokens_BT = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want = random_model(kind, seed=10)(tokens_BT).logits
        model = with_dequantized_bases(random_model(kind, seed=10))
        got = model(tokens_BT).logits
        cache = model.new_cache()
        model.forward_cached(tokens_BT[:, :6], cache)
        got_cached = torch.cat([model.forward_cached(tokens_BT[:, t : t + 1], cache).logits for t in range(6, 12)], dim=1)
    bases = [layer.experts.dequantize for layer in model.moe_layers]
    assert all(isinstance(b, DequantizedBases) and b._by_codes for b in bases), "the once-dequantized bases were not read"
    assert torch.equal(got, want)
    assert max_rel(got_cached, want[:, 6:]) < FP32_REL


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decoding_with_the_cache_gives_the_token_ids_of_the_full_recompute(kind):
    model = random_model(kind, seed=4)
    prompt = [3, 17, 5]
    args = dict(max_new_tokens=25, temperature=0.0, top_k=0, max_context=28)  # 3 + 25 fits the window
    want = sample_without_cache(model, prompt, generator=torch.Generator(), **args)
    got = sample(model, prompt, generator=torch.Generator(), **args)
    assert got == want
    assert len(set(got[3:])) > 3, "a degenerate model (one repeated token) would prove little"


@pytest.mark.parametrize("kind", ["moe", "nf4"])
def test_sampling_with_the_cache_draws_the_same_tokens_as_the_full_recompute_from_the_same_seed(kind):
    model = random_model(kind, seed=5)
    args = dict(max_new_tokens=20, temperature=1.0, top_k=10, max_context=32)
    want = sample_without_cache(model, [1, 2], generator=torch.Generator().manual_seed(7), **args)
    got = sample(model, [1, 2], generator=torch.Generator().manual_seed(7), **args)
    assert got == want


def test_beyond_the_window_the_cache_restarts_from_the_last_half_and_each_token_follows_its_window():
    """max_context 8, 30 new tokens: whenever 8 positions are cached, the context restarts from
    the last 4 tokens. Each greedy token must be the argmax of a full forward over exactly the
    tokens of its window (a stale cache, or positions not restarting, would change them)."""
    model = random_model("moe", seed=6)
    max_context, keep, prompt = 8, 4, [4, 9, 2]
    out = sample(model, prompt, 30, 0.0, 0, torch.Generator(), max_context)
    assert len(out) == len(prompt) + 30
    start, restarts = 0, 0
    for t in range(len(prompt), len(out)):
        if t - start > max_context:
            start, restarts = t - keep, restarts + 1
        with torch.no_grad():
            logits_V = model(torch.tensor([out[start:t]])).logits[0, -1]
        assert out[t] == int(logits_V.argmax()), f"token {t} (window {start}..{t - 1})"
    assert restarts >= 5


def test_a_prompt_longer_than_the_window_keeps_its_last_max_context_tokens():
    model = random_model("dense", seed=7)
    prompt = list(range(20))
    want = sample_without_cache(model, prompt, 1, 0.0, 0, torch.Generator(), 8)
    got = sample(model, prompt, 1, 0.0, 0, torch.Generator(), 8)
    assert got == want and got[:20] == prompt


def test_the_same_seed_reproduces_a_sample_and_another_seed_changes_it():
    model = random_model("nf4", seed=8)
    draws = [sample(model, [1], 30, 1.0, 0, torch.Generator().manual_seed(s), 64) for s in (11, 11, 12)]
    assert draws[0] == draws[1]
    assert draws[0] != draws[2]


def test_top_k_one_samples_the_most_likely_token():
    logits_V = torch.randn(50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    assert all(next_token(logits_V, 1.5, 1, g) == int(logits_V.argmax()) for _ in range(20))


def test_zero_new_tokens_returns_the_prompt():
    model = random_model("dense")
    assert sample(model, [1, 2, 3], 0, 0.0, 0, torch.Generator(), 8) == [1, 2, 3]


def test_the_text_stream_holds_back_a_partial_utf8_character_until_it_is_complete():
    pieces: list[str] = []
    stream = TextStream(ByteTokenizer().decode, pieces.append)
    for b in "aé".encode():
        stream.push(b)
    assert pieces == ["a", "é"], pieces  # é is two bytes: nothing was written after its first
    stream.push("€".encode()[0])
    assert pieces == ["a", "é"]
    stream.finish()  # an unfinished character at the end is written as decoded (U+FFFD)
    assert "".join(pieces) == "aé\ufffd"


# ---------------------------------------------------------------------------------------------
# From a checkpoint, through the CLI


@pytest.fixture
def byte_checkpoint(tmp_path):
    """A run directory holding one checkpoint of a random NF4 model with peft LoRA on attention,
    byte tokenizer. The LM head's rows of the non-ASCII bytes and EOS are zero: their logits are 0,
    while the top 5 of 128 ASCII logits of std ~5 are positive, so with --top-k 5 every token is
    a whole character."""
    model = random_model("nf4_dense_lora", seed=9, vocab_size=ByteTokenizer.vocab_size)
    with torch.no_grad():
        model.lm_head.weight[128:] = 0.0
    save_checkpoint(tmp_path / "run", model)
    return tmp_path / "run", model


def save_checkpoint(run_dir: Path, model: GrowLM) -> None:
    recipe = to_plain(load_recipe(REPO / "recipes/tiny.yaml"))  # byte tokenizer, seq_len 128
    meta = {"model_config": to_plain(model.config), "recipe": recipe, "stage": 0, "step": 1}
    CheckpointManager(run_dir, CheckpointConfig(), log=lambda s: None).save(1, model_state=model.state_dict(), trainer_state={}, meta=meta)


def test_generating_from_an_nf4_checkpoint_does_not_import_bitsandbytes(tmp_path):
    """Its import is 1-2 s of start-up; the decoding bases make it unnecessary."""
    save_checkpoint(tmp_path / "run", random_model("nf4", seed=11, vocab_size=ByteTokenizer.vocab_size))
    code = (
        "import sys; from growtrain.generate import generate_from_checkpoint; "
        f"generate_from_checkpoint({str(tmp_path / 'run')!r}, 'ab', 5); print('bitsandbytes' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "False"


def test_generate_from_a_checkpoint_with_nf4_experts_and_peft_lora_matches_the_reference_path(byte_checkpoint):
    run, _ = byte_checkpoint
    cached = generate_from_checkpoint(run, "The ", 40, temperature=0.0, top_k=0)
    reference = generate_from_checkpoint(run, "The ", 40, temperature=0.0, top_k=0, use_cache=False)
    assert cached == reference and cached.startswith("The ") and len(cached) > len("The ")


class FlushRecorder:
    """A stdout that records, at every flush, the text written so far and how many tokens the
    sampler had drawn by then."""

    def __init__(self, drawn: list[int]):
        self.text, self.drawn, self.flushes = "", drawn, []

    def write(self, s: str) -> int:
        self.text += s
        return len(s)

    def flush(self) -> None:
        self.flushes.append((len(self.drawn), self.text))


def test_the_generate_command_prints_each_token_as_it_is_sampled_and_flushes(byte_checkpoint, monkeypatch, capsys):
    run, _ = byte_checkpoint
    drawn: list[int] = []
    real_next_token = gen.next_token

    def counting_next_token(*args, **kwargs):
        drawn.append(real_next_token(*args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(gen, "next_token", counting_next_token)
    recorder = FlushRecorder(drawn)
    monkeypatch.setattr("sys.stdout", recorder)
    n = 30
    assert main(["generate", str(run), "--prompt", "The ", "--max-new-tokens", str(n), "--seed", "3", "--top-k", "5"]) == 0
    text = ByteTokenizer().decode(drawn)
    assert recorder.text == "The " + text + "\n"
    # the prompt is flushed before the first token is drawn, then one flush per token, right after it
    shown = [(count, t) for count, t in recorder.flushes if t]
    assert shown[0] == (0, "The ")
    assert [count for count, _ in shown[1 : n + 1]] == list(range(1, n + 1))
    assert all(t == "The " + ByteTokenizer().decode(drawn[:count]) for count, t in shown[1 : n + 1])
    assert "30 tokens in" in capsys.readouterr().err


def test_the_generate_command_with_no_cache_prints_the_same_text(byte_checkpoint, capsys):
    run, _ = byte_checkpoint
    outs = []
    for flags in ([], ["--no-cache"]):
        assert main(["generate", str(run), "--prompt", "x", "--max-new-tokens", "12", "--seed", "5", *flags]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and len(outs[0]) > len("x\n")
