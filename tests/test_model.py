"""Model tests: the parameter-name contract, MoE against a per-token loop, the grouped expert
reference, balance bias, routing replay, causality, determinism, GQA. CPU, fp32/fp64, tiny sizes.

Legend: T tokens, D d_model, E experts, K top-k, F expert hidden width, N sorted rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from growtrain.kernels.reference import grouped_swiglu_reference
from growtrain.model import EXPERT_BACKENDS, GrowLM, ModelConfig, MoEConfig, get_expert_backend, update_balance_bias
from growtrain.model.layers import Attention, rope_cos_sin
from growtrain.model.moe import MoE

V, D, H, F_DENSE, E, K, F_EXP = 37, 16, 4, 24, 4, 2, 12


def tiny_config(moe_layers=(), shared=0, n_kv_heads=0, score_func="softmax", rate=0.0, top_k=K, n_layers=2):
    moe = MoEConfig(
        num_experts=E,
        top_k=top_k,
        expert_hidden=F_EXP,
        score_func=score_func,
        shared_expert_hidden=shared,
        balance_bias_rate=rate,
        router_init_std=0.5,  # spread-out scores so top-k picks differ between tokens
    )
    return ModelConfig(
        vocab_size=V,
        d_model=D,
        n_layers=n_layers,
        n_heads=H,
        n_kv_heads=n_kv_heads,
        ffn_hidden=F_DENSE,
        moe=moe if moe_layers else None,
        moe_layers=tuple(moe_layers),
    )


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    hd, kv = cfg.head_size, cfg.kv_heads
    shapes = {"embed.weight": (V, D)}
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes |= {
            p + "f.norm.weight": (D,),
            p + "f.attn.wq.weight": (H * hd, D),
            p + "f.attn.wk.weight": (kv * hd, D),
            p + "f.attn.wv.weight": (kv * hd, D),
            p + "f.attn.wo.weight": (D, H * hd),
            p + "g.norm.weight": (D,),
        }
        if cfg.is_moe_layer(i):
            shapes |= {
                p + "g.ffn.router.weight": (E, D),
                p + "g.ffn.experts.w_gate": (E, F_EXP, D),
                p + "g.ffn.experts.w_up": (E, F_EXP, D),
                p + "g.ffn.experts.w_down": (E, D, F_EXP),
            }
            if cfg.moe.shared_expert_hidden:
                S = cfg.moe.shared_expert_hidden
                shapes |= {
                    p + "g.ffn.shared.w_gate.weight": (S, D),
                    p + "g.ffn.shared.w_up.weight": (S, D),
                    p + "g.ffn.shared.w_down.weight": (D, S),
                }
        else:
            shapes |= {
                p + "g.ffn.w_gate.weight": (F_DENSE, D),
                p + "g.ffn.w_up.weight": (F_DENSE, D),
                p + "g.ffn.w_down.weight": (D, F_DENSE),
            }
    shapes |= {"final_norm.weight": (D,), "lm_head.weight": (V, D)}
    return shapes


CONTRACT_CONFIGS = {
    "dense": tiny_config(),
    "moe": tiny_config(moe_layers=(1,)),
    "moe_shared_gqa": tiny_config(moe_layers=(0, 1), shared=8, n_kv_heads=2),
}


# ---------------------------------------------------------------- contract


@pytest.mark.parametrize("name", CONTRACT_CONFIGS)
def test_parameter_names_and_shapes_follow_the_contract(name):
    cfg = CONTRACT_CONFIGS[name]
    model = GrowLM(cfg)
    got = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert got == expected_shapes(cfg)
    buffers = {n for n, _ in model.named_buffers()}
    assert buffers == {f"blocks.{i}.g.ffn.router.balance_bias" for i in cfg.moe_layers}
    assert set(model.state_dict()) == set(got) | buffers


@pytest.mark.parametrize("name", CONTRACT_CONFIGS)
def test_meta_construction_gives_the_same_parameter_count_as_cpu(name):
    cfg = CONTRACT_CONFIGS[name]
    with torch.device("meta"):
        meta_model = GrowLM(cfg)
    cpu_model = GrowLM(cfg)
    assert all(p.is_meta for p in meta_model.parameters())
    assert meta_model.num_parameters() == cpu_model.num_parameters()
    assert cpu_model.num_parameters() == sum(int(torch.Size(s).numel()) for s in expected_shapes(cfg).values())
    # A meta model materialized and loaded strictly must accept the CPU state.
    meta_model.to_empty(device="cpu")
    meta_model.load_state_dict(cpu_model.state_dict(), strict=True)


def test_forward_returns_logits_and_zero_aux_loss_for_a_dense_model():
    torch.manual_seed(0)
    out = GrowLM(tiny_config())(torch.randint(0, V, (2, 5)))
    assert out.logits.shape == (2, 5, V) and out.logits.dtype == torch.float32
    assert out.aux_loss.shape == () and out.aux_loss.item() == 0.0
    assert out.moe_stats == []


def test_moe_model_returns_one_stats_entry_per_moe_block_and_sums_their_aux_losses():
    torch.manual_seed(0)
    out = GrowLM(tiny_config(moe_layers=(0, 1)))(torch.randint(0, V, (2, 5)))
    assert len(out.moe_stats) == 2
    torch.testing.assert_close(out.aux_loss, out.moe_stats[0].aux_loss + out.moe_stats[1].aux_loss)
    for s in out.moe_stats:
        assert s.top_k_indices.shape == (10, K) and s.load.shape == (E,)
        assert s.load.sum().item() == 10 * K


def test_init_scales_output_projections_by_depth():
    torch.manual_seed(0)
    cfg = tiny_config().with_changes(d_model=64, ffn_hidden=256, n_layers=8, init_std=0.05)
    model = GrowLM(cfg)
    wq, wo = model.blocks[0].f.attn.wq.weight, model.blocks[0].f.attn.wo.weight
    assert abs(wq.std().item() - 0.05) < 0.01
    assert abs(wo.std().item() - 0.05 / 4) < 0.003
    assert torch.equal(model.final_norm.weight, torch.ones(64))


def test_unknown_expert_backend_lists_the_valid_names():
    with pytest.raises(ValueError, match="reference"):
        get_expert_backend("triton-typo")
    model = GrowLM(tiny_config(moe_layers=(0,)))
    with pytest.raises(ValueError, match="valid: auto, reference"):
        model.set_expert_backend("nope")
    assert "reference" in EXPERT_BACKENDS


def test_invalid_config_reports_every_problem_at_once():
    cfg = tiny_config().with_changes(vocab_size=0, n_kv_heads=3, moe_layers=(5,))
    with pytest.raises(ValueError) as err:
        GrowLM(cfg)
    msg = str(err.value)
    assert "vocab_size" in msg and "n_kv_heads" in msg and "moe_layers" in msg


# ---------------------------------------------------------------- MoE vs per-token loop


def naive_moe(moe: MoE, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token loop over the chosen experts, written independently of the sorted dispatch."""
    cfg = moe.config
    logits_TE = x_TD @ moe.router.weight.T
    scores_TE = logits_TE.softmax(-1) if cfg.score_func == "softmax" else logits_TE.sigmoid()
    idx_TK = (scores_TE + moe.router.balance_bias).topk(cfg.top_k, dim=-1).indices
    ex = moe.experts
    rows, all_gates = [], []
    for t in range(x_TD.shape[0]):
        picked = scores_TE[t, idx_TK[t]]
        gates = picked / picked.sum()
        all_gates.append(gates)
        y = torch.zeros_like(x_TD[t])
        for j in range(cfg.top_k):
            e = int(idx_TK[t, j])
            h = F.silu(ex.w_gate[e] @ x_TD[t]) * (ex.w_up[e] @ x_TD[t])
            y = y + gates[j] * (ex.w_down[e] @ h)
        if moe.shared is not None:
            y = y + moe.shared(x_TD[t])
        rows.append(y)
    return torch.stack(rows), idx_TK, torch.stack(all_gates)


def grads_of(module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad()
    x.grad = None
    (y * w).sum().backward()
    out = {n: p.grad.clone() for n, p in module.named_parameters()}
    out["<input>"] = x.grad.clone()
    return out


def make_moe(score_func="softmax", shared=0, rate=0.0, top_k=K, seed=0) -> MoE:
    torch.manual_seed(seed)
    cfg = tiny_config(moe_layers=(0,), shared=shared, score_func=score_func, rate=rate, top_k=top_k)
    return MoE(cfg).double()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("shared", [0, 8])
def test_moe_layer_matches_per_token_loop_reference_forward_and_backward(score_func, shared):
    moe = make_moe(score_func, shared)
    x_TD = torch.randn(11, D, dtype=torch.float64, requires_grad=True)
    w_TD = torch.randn(11, D, dtype=torch.float64)

    y_TD, stats = moe(x_TD)
    y_ref, idx_ref, gates_ref = naive_moe(moe, x_TD)
    torch.testing.assert_close(y_TD, y_ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(stats.top_k_indices, idx_ref)
    torch.testing.assert_close(gates_ref.sum(-1), torch.ones(11, dtype=torch.float64))
    assert torch.equal(stats.load, torch.bincount(idx_ref.flatten(), minlength=E).float())

    g = grads_of(moe, x_TD, y_TD, w_TD)
    g_ref = grads_of(moe, x_TD, naive_moe(moe, x_TD)[0], w_TD)
    assert g.keys() == g_ref.keys()
    for name in g:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_gates_sum_to_one_so_identical_experts_act_as_one_expert(score_func):
    moe = make_moe(score_func)
    with torch.no_grad():
        for w in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down):
            w.copy_(w[:1].expand_as(w))
    x_TD = torch.randn(9, D, dtype=torch.float64)
    ex = moe.experts
    single = (F.silu(x_TD @ ex.w_gate[0].T) * (x_TD @ ex.w_up[0].T)) @ ex.w_down[0].T
    torch.testing.assert_close(moe(x_TD)[0], single, rtol=1e-12, atol=1e-12)


def test_moe_accepts_batched_input_and_keeps_its_shape():
    moe = make_moe()
    x_BTD = torch.randn(2, 3, D, dtype=torch.float64)
    y_BTD, stats = moe(x_BTD)
    assert y_BTD.shape == x_BTD.shape and stats.top_k_indices.shape == (6, K)
    torch.testing.assert_close(y_BTD.reshape(6, D), moe(x_BTD.reshape(6, D))[0], rtol=0, atol=0)


def test_aux_loss_combines_load_balance_and_z_loss_with_their_coefficients():
    moe = make_moe("sigmoid")
    x_TD = torch.randn(10, D, dtype=torch.float64)
    _, stats = moe(x_TD)
    logits = x_TD @ moe.router.weight.T
    scores = logits.sigmoid()
    probs = scores / scores.sum(-1, keepdim=True)
    frac = stats.load.double() / (10 * K)
    balance = E * (frac * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).pow(2).mean()
    expected = moe.config.aux_loss_coef * balance + moe.config.z_loss_coef * z
    torch.testing.assert_close(stats.aux_loss, expected)
    assert stats.aux_loss.requires_grad  # it is a loss term, returned with its graph


def test_router_computes_fp32_logits_under_autocast():
    torch.manual_seed(0)
    moe = MoE(tiny_config(moe_layers=(0,)))
    x_TD = torch.randn(5, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert moe.router(x_TD).dtype == torch.float32
        y, stats = moe(x_TD)
    assert y.dtype == torch.float32 and stats.aux_loss.dtype == torch.float32


# ---------------------------------------------------------------- grouped expert reference


def per_row_swiglu(x_ND, offsets, wg, wu, wd):
    rows = []
    for e in range(wg.shape[0]):
        for n in range(int(offsets[e]), int(offsets[e + 1])):
            rows.append(wd[e] @ (F.silu(wg[e] @ x_ND[n]) * (wu[e] @ x_ND[n])))
    return torch.stack(rows) if rows else x_ND.new_zeros(0, wd.shape[1])


@pytest.mark.parametrize(
    "counts,d,f",
    [
        ([3, 2, 4], 8, 6),  # every expert busy
        ([0, 3, 0, 2], 7, 5),  # empty experts, odd sizes
        ([0, 0, 5, 0], 5, 3),  # all tokens on one expert
        ([1, 0, 0], 3, 1),  # a single token
        ([0, 0, 0], 4, 2),  # no tokens at all
    ],
)
def test_grouped_reference_matches_per_row_loop_forward_and_backward(counts, d, f):
    torch.manual_seed(0)
    e, n = len(counts), sum(counts)
    offsets = torch.tensor([0] + counts, dtype=torch.long).cumsum(0)
    x = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    ws = [
        torch.randn(e, f, d, dtype=torch.float64, requires_grad=True),
        torch.randn(e, f, d, dtype=torch.float64, requires_grad=True),
        torch.randn(e, d, f, dtype=torch.float64, requires_grad=True),
    ]
    y = grouped_swiglu_reference(x, offsets, *ws)
    y_ref = per_row_swiglu(x, offsets, *ws)
    assert y.shape == (n, d)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-12)
    if n == 0:
        return
    w_out = torch.randn(n, d, dtype=torch.float64)
    got = torch.autograd.grad((y * w_out).sum(), [x, *ws])
    ref = torch.autograd.grad((y_ref * w_out).sum(), [x, *ws], allow_unused=True)
    for name, a, b in zip(["x", "w_gate", "w_up", "w_down"], got, ref):
        torch.testing.assert_close(a, b if b is not None else torch.zeros_like(a), msg=lambda m, n=name: f"{n}: {m}")


def test_grouped_reference_rejects_offsets_that_do_not_cover_the_rows():
    x = torch.randn(4, 3)
    w = torch.randn(2, 2, 3), torch.randn(2, 2, 3), torch.randn(2, 3, 2)
    with pytest.raises(ValueError, match="offsets"):
        grouped_swiglu_reference(x, torch.tensor([0, 1, 3]), *w)
    with pytest.raises(ValueError, match="E \\+ 1"):
        grouped_swiglu_reference(x, torch.tensor([0, 4]), *w)


# ---------------------------------------------------------------- balance bias and routing replay


def test_balance_bias_changes_selection_but_gates_stay_normalized_scores():
    moe = make_moe("sigmoid")
    x_TD = torch.randn(12, D, dtype=torch.float64)
    _, before = moe(x_TD)
    with torch.no_grad():
        moe.router.balance_bias[3] = 10.0  # forces expert 3 into every token's top-k
    y_TD, after = moe(x_TD)
    assert (after.top_k_indices == 3).any(-1).all()
    assert not torch.equal(before.top_k_indices, after.top_k_indices)
    # Gates come from the unbiased scores: the per-token loop (which renormalizes raw scores at the
    # biased choice) agrees.
    y_ref, idx_ref, gates_ref = naive_moe(moe, x_TD)
    assert torch.equal(idx_ref, after.top_k_indices)
    torch.testing.assert_close(y_TD, y_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gates_ref.sum(-1), torch.ones(12, dtype=torch.float64))


def test_balance_bias_is_a_persistent_buffer_that_survives_a_state_dict_round_trip():
    moe = make_moe()
    assert "router.balance_bias" in moe.state_dict()
    assert "router.balance_bias" not in dict(moe.named_parameters())
    with torch.no_grad():
        moe.router.balance_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    fresh = make_moe(seed=1)
    fresh.load_state_dict(moe.state_dict(), strict=True)
    assert torch.equal(fresh.router.balance_bias, moe.router.balance_bias)


def test_update_balance_bias_raises_underloaded_and_lowers_overloaded_experts():
    moe = make_moe(rate=0.01)
    update_balance_bias(moe, torch.tensor([10.0, 0.0, 5.0, 5.0]))
    torch.testing.assert_close(moe.router.balance_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0], dtype=torch.float64))
    off = make_moe(rate=0.0)
    update_balance_bias(off, torch.tensor([10.0, 0.0, 5.0, 5.0]))
    assert torch.equal(off.router.balance_bias, torch.zeros(E, dtype=torch.float64))


def test_model_update_balance_biases_applies_each_layers_load_in_block_order():
    torch.manual_seed(0)
    model = GrowLM(tiny_config(moe_layers=(0, 1), rate=0.5))
    out = model(torch.randint(0, V, (2, 6)))
    model.update_balance_biases([s.load for s in out.moe_stats])
    for layer, s in zip(model.moe_layers, out.moe_stats):
        expected = 0.5 * torch.sign(s.load.mean() - s.load)
        torch.testing.assert_close(layer.router.balance_bias, expected)
    with pytest.raises(ValueError):
        model.update_balance_biases([out.moe_stats[0].load])


def test_passing_routing_reproduces_the_original_forward():
    moe = make_moe("softmax", shared=8)
    x_TD = torch.randn(10, D, dtype=torch.float64, requires_grad=True)
    y_TD, stats = moe(x_TD)
    with torch.no_grad():
        moe.router.balance_bias.add_(torch.tensor([5.0, -5.0, 0.0, 0.0], dtype=torch.float64))
    y_replay, replay_stats = moe(x_TD, routing=stats.top_k_indices)
    assert torch.equal(y_TD, y_replay)
    assert torch.equal(replay_stats.top_k_indices, stats.top_k_indices)
    torch.testing.assert_close(replay_stats.aux_loss, stats.aux_loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="routing"):
        moe(x_TD, routing=stats.top_k_indices[:3])


def test_coupling_block_replays_routing_and_inverts_exactly_in_fp64():
    torch.manual_seed(0)
    model = GrowLM(tiny_config(moe_layers=(0,))).double()
    block = model.blocks[0]
    x1, x2 = torch.randn(2, 2, 5, D, dtype=torch.float64).unbind(0)
    y1, y2, stats = block(x1, x2)
    y1r, y2r, _ = block(x1, x2, routing=stats.top_k_indices)
    assert torch.equal(y1, y1r) and torch.equal(y2, y2r)
    # The inverse the reversible backward will use: x2 = y2 - G(y1), x1 = y1 - F(x2).
    g_out, _ = block.g(y1, routing=stats.top_k_indices)
    x2_rec = y2 - g_out
    x1_rec = y1 - block.f(x2_rec)
    torch.testing.assert_close(x2_rec, x2, rtol=0, atol=1e-12)
    torch.testing.assert_close(x1_rec, x1, rtol=0, atol=1e-12)


# ---------------------------------------------------------------- whole model


@pytest.mark.parametrize("moe_layers", [(), (1,)])
def test_changing_a_later_token_does_not_change_earlier_logits(moe_layers):
    torch.manual_seed(0)
    model = GrowLM(tiny_config(moe_layers=moe_layers, n_kv_heads=2))
    tokens = torch.randint(0, V, (2, 9))
    changed = tokens.clone()
    changed[:, 6:] = (changed[:, 6:] + 1) % V
    a, b = model(tokens).logits, model(changed).logits
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_two_seeded_forward_backward_runs_give_bitwise_identical_grads():
    def run():
        torch.manual_seed(1234)
        model = GrowLM(tiny_config(moe_layers=(1,), shared=8, n_kv_heads=2))
        tokens = torch.randint(0, V, (2, 8))
        out = model(tokens)
        loss = F.cross_entropy(out.logits.flatten(0, 1), tokens.roll(-1, 1).flatten()) + out.aux_loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters()}

    loss_a, grads_a = run()
    loss_b, grads_b = run()
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert grads_a[name] is not None, name
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_gqa_matches_multi_head_attention_with_duplicated_kv_heads():
    torch.manual_seed(0)
    gqa_cfg = tiny_config(n_kv_heads=2)
    gqa = Attention(gqa_cfg).double()
    mha = Attention(gqa_cfg.with_changes(n_kv_heads=H)).double()
    hd = gqa_cfg.head_size
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        # Query head h reads kv head h // (H // KV): repeat each kv head's rows H // KV times.
        for name in ("wk", "wv"):
            w = getattr(gqa, name).weight.view(2, hd, D).repeat_interleave(H // 2, dim=0).reshape(H * hd, D)
            getattr(mha, name).weight.copy_(w)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    torch.testing.assert_close(gqa(x), mha(x), rtol=1e-12, atol=1e-12)
    assert gqa.wk.weight.shape == (2 * hd, D)


def test_attention_matches_an_explicit_causal_softmax_with_rope():
    torch.manual_seed(0)
    cfg = tiny_config(n_kv_heads=2)
    attn = Attention(cfg).double()
    B, T, hd = 1, 6, cfg.head_size
    x = torch.randn(B, T, D, dtype=torch.float64)
    cos, sin = rope_cos_sin(T, hd, cfg.rope_theta, dtype=torch.float64)
    assert cos.shape == (T, hd // 2) and torch.equal(cos[0], torch.ones(hd // 2))

    def rotate(v):  # v: [T, hd], half-split rotation by angle pos * theta^(-2i/hd)
        a, b = v[:, : hd // 2], v[:, hd // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    q = (x[0] @ attn.wq.weight.T).view(T, H, hd)
    k = (x[0] @ attn.wk.weight.T).view(T, 2, hd)
    v = (x[0] @ attn.wv.weight.T).view(T, 2, hd)
    heads = []
    for h in range(H):
        qh, kh = rotate(q[:, h]), rotate(k[:, h // 2])
        s = qh @ kh.T / hd**0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(s.softmax(-1) @ v[:, h // 2])
    expected = torch.cat(heads, -1) @ attn.wo.weight.T
    torch.testing.assert_close(attn(x)[0], expected, rtol=1e-12, atol=1e-12)
