"""Where a training step's record goes: metrics.jsonl (rank 0 writes it), Weights & Biases (with
each MoE layer's load ratio and, on the steps that print a line, memory and throughput), and a
console line every `train.log_every` steps, at a stage's end, and HEARTBEAT_S after the last line
whatever log_every says (progress.py)."""

from __future__ import annotations

import resource

import torch

from growtrain.runtime.progress import Progress
from growtrain.runtime.tracking import Console, MetricsFile, Tracker, format_duration


def af_fields(waits: list[float], passes_s: float, microbatches: int) -> dict[str, float]:
    """An AF layout's step numbers: what the planner's pipeline model predicts (docs/scale.md, AF mode).
    `waits`: the attention side's share of the passes spent waiting, the expert side's idle share,
    and each side's compute (its ranks' mean; the passes less the waits)."""
    attention_wait, expert_idle, attention_busy, expert_busy = waits
    return {
        "af/attention_wait_fraction": attention_wait,
        "af/expert_idle_fraction": expert_idle,
        "af/passes_s": passes_s,
        "af/attention_s_per_microbatch": attention_busy / microbatches,
        "af/expert_s_per_microbatch": expert_busy / microbatches,
        "af/microbatches": microbatches,
    }


class StepReport:
    def __init__(self, console: Console, metrics: MetricsFile, tracker: Tracker, progress: Progress, device: torch.device,
                 peak_tflops: float | None, ranks: int, is_main: bool, log_every: int):
        self.console, self.metrics, self.tracker, self.progress = console, metrics, tracker, progress
        self.device, self.peak_tflops, self.ranks, self.is_main, self.log_every = device, peak_tflops, ranks, is_main, log_every

    def __call__(self, record: dict, stage_index: int, stage_step: int, stage_end: bool, step_s: float, load_ratios: list[float]) -> None:
        step = record["step"]
        line_due = step % self.log_every == 0 or stage_end or self.progress.line_due()
        if line_due and self.device.type == "cuda":  # in metrics.jsonl too: the GPU checks read them there
            record["memory/cuda_peak_gb"] = torch.cuda.max_memory_allocated(self.device) / 1e9
            record["memory/cuda_reserved_gb"] = torch.cuda.memory_reserved(self.device) / 1e9
            torch.cuda.reset_peak_memory_stats(self.device)  # the next line's peak is since this one
        if self.is_main:
            self.metrics.append(record)
        wandb_metrics = {k: v for k, v in record.items() if k not in ("step", "stage")}
        wandb_metrics["stage_index"] = stage_index
        for i, ratio in enumerate(load_ratios):
            wandb_metrics[f"moe/layer{i}/load_max_over_mean"] = ratio
        if line_due:
            self._line(record, wandb_metrics, stage_index, stage_step, step_s)
        self.tracker.log_metrics(wandb_metrics, step)
        self.console.advance(step)

    def _line(self, record: dict, wandb_metrics: dict, stage_index: int, stage_step: int, step_s: float) -> None:
        rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        wandb_metrics["memory/peak_rss_mb"] = rss_mb
        # Counted FLOPs (the planner's, reversible recompute included) per second of this step.
        tflops = self.progress.step_costs[stage_index] / max(step_s, 1e-9) / 1e12 / self.ranks
        wandb_metrics["perf/tflops_per_device"] = tflops
        gpu = ""
        if self.device.type == "cuda":
            gpu = f" gpu {record['memory/cuda_peak_gb']:.1f}GB"
            if self.peak_tflops:
                wandb_metrics["perf/flops_utilisation"] = tflops / self.peak_tflops
                gpu += f" fu {tflops / self.peak_tflops:.0%}"
        evl = f" eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""
        if "af/attention_wait_fraction" in record:
            gpu += f" af wait {record['af/attention_wait_fraction']:.0%} idle {record['af/expert_idle_fraction']:.0%}"
        self.console.write(
            f"[{record['stage']}] step {record['step']}/{self.console.total} loss {record['loss']:.4f}{evl} lr {record['lr']:.2e} "
            f"gnorm {record['grad_norm']:.3f} tok/s {record['tokens_per_s']:,.0f} mem {rss_mb:,.0f}MB{gpu} "
            f"eta {format_duration(self.progress.eta_seconds(stage_index, stage_step))}"
        )
        self.progress.line_written()
