"""`growtrain generate`: sample from a checkpoint with a KV cache, streaming text as it comes.

`sample` prefills the context once, then feeds one token per step against each block's cached
attention keys and values (GrowLM.forward_cached): 200 tokens of the tiny recipe's final model
(256 NF4 experts per MoE layer) take seconds instead of the minute and a half of recomputing the
whole context for every token (`sample_without_cache`, kept as the reference the tests compare
against). Both pick tokens with `next_token`, so equal logits give equal tokens. Two more things
make the time: decoding runs on one CPU thread (`one_cpu_thread`), and NF4 experts read bases
dequantized once (`with_dequantized_bases`, bit-identical), so bitsandbytes is not even imported.

Longer than the context (the largest seq_len the model was trained at): a sliding window. The
reference recomputes the last `max_context` tokens at every step. The cached sampler, when its
cache is full, rebuilds it from the last `max_context // 2` tokens (positions from 0 again, as in
training) and continues: one prefill every `max_context // 2` tokens, and every token sees between
half and all of a window. Up to `max_context` tokens fed, the two agree (see the tests).

Legend: V vocabulary.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Sequence

import torch

from growtrain.checkpoint.store import resolve
from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig
from growtrain.data.tokenizer import checkpoint_tokenizer


def _ids(tokens: list[int], model: GrowLM) -> torch.Tensor:
    """[1, T] token ids on the model's device."""
    return torch.tensor([tokens], device=next(model.parameters()).device)


def next_token(logits_V: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy for temperature <= 0; otherwise a draw from softmax(logits / temperature) over the
    top_k most likely tokens (all of them for top_k <= 0)."""
    logits_V = logits_V.float().cpu()  # the draw on the host: one copy per token, the same text on any device
    if temperature <= 0:
        return int(logits_V.argmax())
    logits_V = logits_V / temperature
    if 0 < top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits_V, -1), 1, generator=generator))


@torch.no_grad()
def sample_without_cache(
    model: GrowLM,
    ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
    max_context: int,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The reference: every token recomputes the whole context (its last `max_context` tokens)."""
    out = list(ids)
    for _ in range(max_new_tokens):
        logits_V = model(_ids(out[-max_context:], model)).logits[0, -1]
        out.append(next_token(logits_V, temperature, top_k, generator))
        if on_token is not None:
            on_token(out[-1])
    return out


@contextmanager
def one_cpu_thread(model: GrowLM):
    """Run a CPU model's decoding on one intra-op thread, then restore the setting. A decoding
    step is many microsecond-sized ops on one row: handing each to a second OpenMP thread costs
    more than the work, and when the cores are busy far more (the tiny recipe's final model, 200
    tokens, three runs each on 2 cores shared with other jobs: 1.0-1.5 s at one thread, 1.0-15.5 s
    at two)."""
    threads = torch.get_num_threads()
    on_cpu = next(model.parameters()).device.type == "cpu"
    if on_cpu:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if on_cpu:
            torch.set_num_threads(threads)


@torch.no_grad()
def sample(
    model: GrowLM,
    ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
    max_context: int,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """`ids` and `max_new_tokens` sampled tokens after them, with a KV cache (sliding window: see
    the module docstring). `on_token` is called with each token as soon as it is drawn."""
    if max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    keep = max(1, max_context // 2)
    out = list(ids)
    if max_new_tokens <= 0:
        return out
    with one_cpu_thread(model):
        cache = model.new_cache(max_context)
        logits_V = model.forward_cached(_ids(out[-max_context:], model), cache).logits[0, -1]
        for i in range(max_new_tokens):
            token = next_token(logits_V, temperature, top_k, generator)
            out.append(token)
            if on_token is not None:
                on_token(token)
            if i == max_new_tokens - 1:
                break
            if cache.length < max_context:
                logits_V = model.forward_cached(_ids([token], model), cache).logits[0, -1]
            else:  # the window is full: rebuild it from the last `keep` tokens
                cache = model.new_cache(max_context)
                logits_V = model.forward_cached(_ids(out[-keep:], model), cache).logits[0, -1]
    return out


class TextStream:
    """Token ids in, text pieces out as soon as they are final: a trailing U+FFFD (an incomplete
    UTF-8 sequence of the byte tokenizer, or a partial byte-level BPE token) is held back until the
    next token completes it, and so is text that a later token changes (decoding all ids so far
    each time: quadratic, but a few hundred tokens decode in milliseconds)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], write: Callable[[str], None]):
        self.decode, self.write = decode, write
        self.ids: list[int] = []
        self.shown = ""

    def push(self, token: int) -> None:
        self.ids.append(token)
        text = self.decode(self.ids)
        if not text.endswith("\ufffd") and text.startswith(self.shown):
            self._show(text)

    def finish(self) -> None:
        """Write what was held back (the text is complete now)."""
        text = self.decode(self.ids)
        self._show(text if text.startswith(self.shown) else self.shown + text[len(self.shown) :])

    def _show(self, text: str) -> None:
        if len(text) > len(self.shown):
            self.write(text[len(self.shown) :])
            self.shown = text


def write_flushed(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


# Above this many bytes of dequantized NF4 bases per MoE layer, decoding keeps dequantizing the
# active experts at each call instead of holding every expert in fp32.
DEQUANTIZED_BASES_LIMIT = 1 << 30


class DequantizedBases:
    """`dequantize(stack, experts)` for the NF4 reference backend while decoding: each matrix's
    experts dequantized once, then indexed. By the pure-PyTorch dequantizer, which gives
    bitsandbytes' values bit for bit (tests/test_nf4_experts.py), so the logits do not change;
    what changes is time: a decoding step activates top_k experts per MoE layer and would
    dequantize them again at every step, and bitsandbytes' import alone is 1-2 s of a 200-token
    run's start-up (it pulls in torch.compile's stack)."""

    def __init__(self):
        self._by_codes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, stack, experts_K: list[int]) -> torch.Tensor:
        from growtrain.kernels.nf4_reference import dequantize_experts_torch

        held = self._by_codes.get(id(stack.codes_EP))
        if held is None or held[0] is not stack.codes_EP:
            held = (stack.codes_EP, dequantize_experts_torch(stack, list(range(stack.num_experts))))
            self._by_codes[id(stack.codes_EP)] = held
        index_K = torch.as_tensor(experts_K, dtype=torch.long, device=held[1].device)
        return held[1].index_select(0, index_K)


def with_dequantized_bases(model: GrowLM) -> GrowLM:
    """`model` with its NF4 experts (those on the reference backend, when their fp32 bases fit
    DEQUANTIZED_BASES_LIMIT) reading `DequantizedBases`: same logits, bit for bit. For a model
    that is only sampled from: the bases are dequantized once, so later changes to the codes would
    not be seen."""
    for layer in model.moe_layers:
        experts = layer.experts
        if not getattr(experts, "is_nf4", False) or layer.expert_backend != "reference":
            continue
        if 3 * experts.num_experts * experts.hidden * experts.d_model * 4 > DEQUANTIZED_BASES_LIMIT:
            continue
        experts.dequantize = DequantizedBases()
    return model


def load_model(loaded, device: torch.device | str = "cpu") -> GrowLM:
    """The checkpoint's model, built on the meta device and loaded with assign (no random init to
    throw away: the NF4 experts' init quantizes random weights, ~1500 bitsandbytes calls for the
    tiny recipe's final model); strict, so a missing or renamed key fails here."""
    with torch.device("meta"):
        model = GrowLM(ModelConfig.from_dict(loaded.meta["model_config"]))
    model.load_state_dict({k: v.to(device) for k, v in loaded.model_state.items()}, strict=True, assign=True)
    # The run's train.expert_backend, resolved for where the weights now are (auto: the reference on
    # the CPU); checkpoints from before the setting existed mean auto.
    model.set_expert_backend((loaded.meta.get("recipe") or {}).get("train", {}).get("expert_backend", "auto"))
    return model.eval()


def generate_from_checkpoint(
    path: Path,
    prompt: str,
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    stream: Callable[[str], None] | None = None,
    use_cache: bool = True,
    report: Callable[[str], None] | None = None,
    device: str = "auto",
) -> str:
    """Prompt plus continuation. `stream` receives the prompt once the model has loaded, then the
    continuation piece by piece as it is sampled; `use_cache=False` samples with the reference `sample_without_cache`; `report` gets one
    line of timing."""
    t0 = time.perf_counter()
    loaded = resolve(path)
    meta = loaded.meta
    where = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device))
    model = with_dequantized_bases(load_model(loaded, where))
    tokenizer = checkpoint_tokenizer(loaded.path, meta)
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    max_context = max(s["seq_len"] for s in meta["recipe"]["stages"])
    generator = torch.Generator().manual_seed(seed)
    t1 = time.perf_counter()
    text_stream = TextStream(tokenizer.decode, stream) if stream is not None else None
    if stream is not None:
        stream(prompt)
    sampler = sample if use_cache else sample_without_cache
    out = sampler(model, ids, max_new_tokens, temperature, top_k, generator, max_context, text_stream.push if text_stream else None)
    if text_stream is not None:
        text_stream.finish()
    t2 = time.perf_counter()
    if report is not None:
        n = len(out) - len(ids)
        report(
            f"{n} tokens in {t2 - t1:.2f} s ({n / max(t2 - t1, 1e-9):.1f} tokens/s, {'KV cache' if use_cache else 'no cache'}, "
            f"context window {max_context}); loading took {t1 - t0:.2f} s"
        )
    return prompt + tokenizer.decode(out[len(ids):])
