"""The console tables of `growtrain plan`: parameters, memory per GPU, roofline, growth peaks and
the AF search, from a typed `Plan`."""

from __future__ import annotations

from growtrain.planning.disaggregation import AfNotApplicable
from growtrain.planning.hardware import GB
from growtrain.planning.memory import HEADROOM_TARGET
from growtrain.planning.recipe import Plan


def _where(s) -> str:
    where = "GPU" if s.growth_on == "gpu" else "host"
    return where if s.growth_fits else f"does not fit on the {where}"


def _b(n: float) -> str:
    return f"{n / GB:.1f}"


def _p(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _t(s: float) -> str:
    if s >= 86400:
        return f"{s / 86400:.1f} d"
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def _tokens(n: float) -> str:
    """Tokens of a stage: billions at scale, millions or thousands for small recipes (not 0.0B)."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale / 10:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def format_plan(plan: Plan) -> str:
    hw = plan.hardware
    out = [
        (
            f"{plan.recipe}: {len(plan.stages)} stage(s) on {hw.nodes} node(s) x {hw.gpus_per_node} {hw.name} "
            f"({hw.peak_tflops:.0f} TFLOP/s bf16, HBM {hw.hbm_gbps:.0f} GB/s, NVLink {hw.nvlink_gbps:.0f} GB/s/dir, "
            f"NIC {hw.nic_gbps:.0f} GB/s, {hw.capacity_gb:.0f} GB; {hw.source})"
        ),
        f"layout: {plan.layout}",
        "",
        "parameters (exact, from the meta-device models)",
        f"{'stage':<12}{'stored':>9}{'active':>9}{'attention':>10}{'router':>9}{'shared':>9}{'experts':>9}{'dense ffn':>10}{'embed':>8}{'adapters':>9}{'E':>5}{'k':>4}{'format':>7}",
    ]
    for s in plan.stages:
        r = s.params_by_role
        out.append(
            f"{s.name:<12}{_p(s.params_total):>9}{_p(s.params_active):>9}{_p(r['attention']):>10}{_p(r['router']):>9}"
            f"{_p(r['shared_expert']):>9}{_p(r['routed_experts']):>9}{_p(r['dense_ffn']):>10}{_p(r['embeddings']):>8}"
            f"{_p(r['adapters']):>9}{s.experts:>5}{s.top_k:>4}{s.expert_format or '-':>7}"
        )
    out += [
        "",
        "memory per GPU (GB; activations at the stage's micro-batch)",
        f"{'stage':<12}{'mb x seq':>10}{'weights':>9}{'(nf4)':>7}{'grads':>7}{'optim':>7}{'activ':>7}{'work':>6}{'comm':>6}{'rsv':>5}{'total':>8}{'cap':>6}{'headroom':>9}{'max mb':>7}",
    ]
    for s in plan.stages:
        m = s.memory
        flag = "" if s.fits else "  OVER"
        out.append(
            f"{s.name:<12}{str(s.micro_batch) + ' x ' + str(s.seq_len):>10}{_b(m.weights_total_bytes):>9}{_b(m.weights_bytes.get('nf4', 0)):>7}"
            f"{_b(m.gradients_bytes):>7}{_b(m.optimizer_bytes):>7}{_b(m.activations_bytes):>7}{_b(m.workspace_bytes):>6}{_b(m.communication_bytes):>6}"
            f"{_b(m.runtime_reserve_bytes):>5}{_b(m.total_bytes):>8}{_b(s.capacity_bytes):>6}{s.headroom:>8.1%}{s.max_micro_batch:>7}{flag}"
        )
    out += [
        "",
        (
            "roofline (step = grad_accum x micro-batch + optimizer + gradient sync; the phase columns are per micro-batch, "
            "each max(FLOPs/peak, bytes/HBM); a2a: expert-parallel dispatch + combine, not overlapped)"
        ),
        f"{'stage':<12}{'tokens/step':>12}{'step':>9}{'dense':>9}{'experts':>9}{'a2a':>9}{'MFU':>7}{'tok/s':>14}{'steps':>8}{'tokens':>9}{'time':>8}",
    ]
    for s in plan.stages:
        t = s.roofline
        out.append(
            f"{s.name:<12}{t.tokens_per_step:>12,}{_t(t.step_time_s):>9}{_t(t.dense_phase_s):>9}{_t(t.expert_phase_s) if s.experts else '-':>9}"
            f"{_t(t.all_to_all_s) if s.experts else '-':>9}{t.mfu:>7.1%}{t.tokens_per_s:>14,.0f}{s.steps:>8,}{_tokens(s.tokens):>9}{_t(s.stage_time_s):>8}"
        )
    grown = [s for s in plan.stages if s.growth_peak_bytes]
    if grown:
        out.append("")
        out.append(
            f"growth at a stage start, peak per rank over {plan.hardware.gpus} expert-parallel processes (each grows its expert shards; "
            "a stage with an operator that cannot gathers the whole model): "
            + ", ".join(f"{s.name} {_b(s.growth_peak_bytes_per_rank)} GB ({_where(s)})" for s in grown)
            + "; in one process: "
            + ", ".join(f"{s.name} {_b(s.growth_peak_bytes)} GB" for s in grown)
        )
        hw = plan.hardware
        out.append(
            f"  growth runs on the GPU within {_b(hw.capacity_bytes * (1 - HEADROOM_TARGET))} GB per rank, else on the host "
            f"(train.grow_on: auto; {_b(hw.host_bytes_per_gpu * (1 - HEADROOM_TARGET))} GB per rank of the node's {hw.host_memory_gb:,.0f} GB "
            f"host memory, less {HEADROOM_TARGET:.0%})"
        )
    af = plan.af
    out.append("")
    if isinstance(af, AfNotApplicable):
        out.append(f"attention/expert disaggregation: not applicable ({af.reason or 'no stages'})")
    else:
        out.append(
            f"attention/expert disaggregation, stage '{af.stage}' ({af.gpus} GPUs, {af.tokens_per_step:,} tokens/step; "
            "each side max(FLOPs/(gpus x peak), bytes/HBM), two micro-batches in flight as af_schedule: interleaved runs them)"
        )
        out.append(f"{'attn':>5}{'expert':>7}{'attention':>11}{'experts':>10}{'transfer':>10}{'step':>10}{'attn GB':>9}{'exp GB':>8}  fits")
        for sp in af.splits:
            mark = "  <- best" if sp is af.best else ""
            out.append(
                f"{sp.attention_gpus:>5}{sp.expert_gpus:>7}{_t(sp.attention_s):>11}{_t(sp.experts_s):>10}{_t(sp.transfer_s):>10}"
                f"{_t(sp.step_time_s):>10}{_b(sp.attention_bytes_per_gpu):>9}{_b(sp.expert_bytes_per_gpu):>8}  {'yes' if sp.fits else 'no '}{mark}"
            )
        best = af.best
        out.append(
            f"best: {best.attention_gpus} attention + {best.expert_gpus} expert GPUs, {_t(best.step_time_s)} per step vs "
            f"{_t(af.colocated_step_time_s)} co-located expert-parallel ({af.speedup_vs_colocated:.2f}x)"
        )
    out.append("")
    out.append(
        "exact: parameter counts, weight/gradient/optimizer bytes (real classes on the meta device). modelled: saved activations "
        "(checked against the saved-tensor meter on CPU models); approximate: workspace, communication buffers, runtime reserve, "
        "every time figure (a roofline, no kernel efficiencies)."
    )
    return "\n".join(out)
