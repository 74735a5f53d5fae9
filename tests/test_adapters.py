"""peft LoRA on the dense attention layers (through peft itself), and `export-adapters`: the
experts' LoRA and peft's dense adapters written in peft's layout, loaded back by peft onto the
base model, computing what the NF4 + LoRA model computes. CPU, tiny shapes."""

from __future__ import annotations

import json

import pytest
import peft
import torch

from conftest import run_cli
from growtrain.checkpoint.store import CheckpointConfig, CheckpointManager
from growtrain.hf.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_model_adapters, load_base_model
from growtrain.model import GrowLM, ModelConfig, MoEConfig
from growtrain.model.config import ExpertLoRAConfig
from growtrain.model.dense_lora import DenseLoRAConfig, apply_dense_lora, is_peft_wrapped
from growtrain.optim.registry import build_optimizer
from growtrain.recipe import OptimizerConfig, to_plain


pytest.importorskip("bitsandbytes")

V = 41


def model_of(expert_format="nf4", seed=0, reversible=True, dtype=torch.float32) -> GrowLM:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=48, router_init_std=0.5, expert_format=expert_format, lora=ExpertLoRAConfig(r=4, lora_alpha=8.0))
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, moe=moe, moe_layers=(0, 1), reversible=reversible)
    torch.manual_seed(seed)
    return GrowLM(cfg).to(dtype)


def perturb_adapters(model, std=0.05):
    """Nonzero B everywhere, so every adapter changes the function."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, std)
    return model


def test_peft_lora_on_attention_freezes_the_base_and_trains_the_adapters():
    model = apply_dense_lora(model_of(), DenseLoRAConfig(r=2, lora_alpha=4.0))
    assert is_peft_wrapped(model)
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "blocks.0.f.attn.wq.lora_A.default.weight" in names and "blocks.1.f.attn.wo.lora_B.default.weight" in names
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"blocks.{i}.f.attn.{w}.base_layer.weight" for i in range(2) for w in ("wq", "wk", "wv", "wo")}
    assert "embed.weight" in names and "blocks.0.g.ffn.router.weight" in names  # the other dense parts still train
    opt = build_optimizer(dict(model.named_parameters()), OptimizerConfig())
    assert not any("base_layer" in n for n in opt.state_dict())


def test_peft_wrapped_model_gets_the_same_gradients_with_the_reversible_backward_as_with_plain_autograd():
    tokens = torch.randint(0, V, (2, 9))
    grads = []
    for reversible in (True, False):
        model = perturb_adapters(apply_dense_lora(model_of(seed=2, reversible=reversible, dtype=torch.float64), DenseLoRAConfig(r=2)))
        out = model(tokens)
        (out.logits.square().mean() + out.aux_loss).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        assert grads[0][n] is not None and torch.allclose(grads[0][n], grads[1][n], rtol=1e-9, atol=1e-12), n
    assert grads[0]["blocks.1.f.attn.wv.lora_A.default.weight"].abs().sum() > 0


def _peft_logits(out_dir, tokens):
    base = load_base_model(out_dir)
    base.eval()
    with torch.no_grad():
        plain = base(tokens).logits
    wrapped = peft.PeftModel.from_pretrained(base, str(out_dir))
    wrapped.eval()
    with torch.no_grad():
        return plain, wrapped(tokens).logits


@pytest.mark.parametrize("dense_r", [None, 4, 2], ids=["experts only", "dense same rank", "dense other rank"])
def test_exported_adapters_load_into_peft_and_compute_what_the_nf4_lora_model_computes(tmp_path, dense_r):
    model = model_of()
    if dense_r is not None:
        model = apply_dense_lora(model, DenseLoRAConfig(r=dense_r, lora_alpha=8.0))
    perturb_adapters(model)
    model.eval()
    export_model_adapters(model, tmp_path, with_base=True)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == ["experts.w_gate", "experts.w_up", "experts.w_down"] and config["r"] == 4
    weights = peft.utils.load_peft_weights(str(tmp_path))
    assert all(k.startswith("base_model.model.blocks.") and ".lora_" in k for k in weights)

    tokens = torch.randint(0, V, (2, 14))
    with torch.no_grad():
        want = model(tokens).logits
    plain, got = _peft_logits(tmp_path, tokens)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() < 1e-5 * scale, "peft's model and ours disagree"
    assert (plain - want).abs().max().item() > 1e-2 * scale, "the adapters must matter, or the test proves nothing"


def _checkpoint(run_dir, model):
    meta = {"model_config": to_plain(model.config), "stage": 0, "step": 3}
    CheckpointManager(run_dir, CheckpointConfig(), log=lambda s: None).save(3, model_state=model.state_dict(), trainer_state={}, meta=meta)


def test_export_adapters_cli_writes_peft_files_from_a_run_directory(tmp_path):
    model = perturb_adapters(model_of(seed=5))
    model.eval()
    _checkpoint(tmp_path / "run", model)
    out = tmp_path / "adapters"
    done = run_cli("export-adapters", tmp_path / "run", out, "--base")
    assert done.returncode == 0, done.stderr
    assert "adapter parameters" in done.stdout
    assert (out / ADAPTER_CONFIG).is_file() and (out / ADAPTER_WEIGHTS).is_file()
    tokens = torch.randint(0, V, (1, 10))
    with torch.no_grad():
        want = model(tokens).logits
    _, got = _peft_logits(out, tokens)
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()


def test_export_adapters_cli_reports_user_mistakes_without_a_traceback(tmp_path, capsys):
    from growtrain.cli import main

    assert main(["export-adapters", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert "no such file" in capsys.readouterr().err
    _checkpoint(tmp_path / "full", model_of(expert_format="full"))
    assert main(["export-adapters", str(tmp_path / "full"), str(tmp_path / "out")]) == 2
    assert "no adapters" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        main(["export-adapters", "--help"])
    assert done.value.code == 0 and "adapter_config.json" in capsys.readouterr().out
