"""`growtrain generate`: sample from a checkpoint (no KV cache: the demo models are tiny)."""

from __future__ import annotations

from pathlib import Path

import torch

from growtrain.checkpoint import resolve
from growtrain.model import GrowLM
from growtrain.model.config import ModelConfig
from growtrain.tokenizer import build_tokenizer


@torch.no_grad()
def sample(model: GrowLM, ids: list[int], max_new_tokens: int, temperature: float, top_k: int, generator: torch.Generator, max_context: int) -> list[int]:
    out = list(ids)
    for _ in range(max_new_tokens):
        logits_V = model(torch.tensor([out[-max_context:]])).logits[0, -1].float()
        if temperature <= 0:
            out.append(int(logits_V.argmax()))
            continue
        logits_V = logits_V / temperature
        if 0 < top_k < logits_V.numel():
            kth = torch.topk(logits_V, top_k).values[-1]
            logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
        out.append(int(torch.multinomial(torch.softmax(logits_V, -1), 1, generator=generator)))
    return out


def generate_from_checkpoint(path: Path, prompt: str, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 50, seed: int = 0) -> str:
    loaded = resolve(path)
    meta = loaded.meta
    model = GrowLM(ModelConfig.from_dict(meta["model_config"]))
    model.load_state_dict(loaded.model_state, strict=True)
    model.eval()
    tokenizer = build_tokenizer(meta["recipe"]["data"]["tokenizer"])
    ids = tokenizer.encode(prompt) or [tokenizer.eos_id]
    max_context = max(s["seq_len"] for s in meta["recipe"]["stages"])
    out = sample(model, ids, max_new_tokens, temperature, top_k, torch.Generator().manual_seed(seed), max_context)
    return prompt + tokenizer.decode(out[len(ids):])
