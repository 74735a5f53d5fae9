"""`growtrain` command line. Only argparse is imported at module level so `--help` is instant;
each command imports what it needs. User mistakes exit 2 with a message, never a traceback."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from pathlib import Path

EXAMPLES = """\
examples:
  growtrain run recipes/tiny.yaml                      train (resumes from runs/<name> if it holds checkpoints)
  growtrain run recipes/tiny.yaml --set stages.0.steps=50 --out runs/try1
  growtrain validate recipes/tiny.yaml                 check a recipe; exit 2 lists every problem
  growtrain print-config recipes/tiny.yaml             the recipe with every default filled in
  growtrain plan recipes/120b.yaml --hardware h100-80gb   per-stage parameters, memory per GPU, step time
  growtrain inspect runs/tiny --json                   stage, step, tokens, parameters, growth reports
  growtrain generate runs/tiny --prompt "The "         sample from the newest checkpoint
  growtrain plot runs/tiny runs/other --out loss.png   loss against tokens and counted FLOPs, growth marked
  growtrain export-adapters runs/tiny out/adapters     NF4 experts' LoRA (and peft adapters) in peft's layout
  growtrain export-hf runs/tiny --out out/tiny-hf      a folder transformers loads (trust_remote_code=True)
  growtrain prepare-data corpus/ --out data/corpus     tokenize once into token shards; then data.source: data/corpus
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="growtrain",
        description="Grow a small dense language model, stage by stage, into a deep Mixture-of-Experts model.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="train a recipe, resuming from the newest complete checkpoint", description=(
        "Train RECIPE stage by stage. Checkpoints, metrics.jsonl and W&B files go to --out. "
        "If --out already holds checkpoints of this recipe, the run resumes from the newest intact one "
        "(a damaged one is reported and skipped), so re-running the same command after a crash continues it."
    ))
    p.add_argument("recipe", type=Path, help="recipe YAML file, or the name of a packaged recipe (tiny, small, 120b, 120b-rehearsal)")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: runs/<recipe name>)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                   help="override a recipe field, e.g. --set stages.0.steps=50 --set tracking.wandb.mode=disabled (repeatable)")
    p.add_argument("--resume", default="auto", metavar="auto|never|PATH",
                   help="auto (default): continue from the newest complete checkpoint in --out; never: refuse if --out has "
                   "checkpoints; PATH: continue from that checkpoint or run directory")

    for name, helptext in (("validate", "check a recipe: exit 0, or exit 2 listing every problem"),
                           ("print-config", "print the resolved recipe with every default filled in")):
        p = sub.add_parser(name, help=helptext, description=helptext[0].upper() + helptext[1:] + ".")
        p.add_argument("recipe", type=Path, help="recipe YAML file, or the name of a packaged recipe (tiny, small, 120b, 120b-rehearsal)")
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a field")
        if name == "validate":
            p.add_argument("--world-size", type=int, default=1, metavar="N",
                           help="also check what a launch over N processes needs (torchrun --nproc-per-node N: batch sizes "
                           "and expert counts divisible by N, options supported under expert parallelism)")

    sub.add_parser("schema", help="print the recipe reference (every field, type, default, meaning) as Markdown",
                   description="Print the recipe reference: every section and field with its type, default and meaning.")

    p = sub.add_parser("plan", help="per stage and GPU: exact parameters, memory against capacity, roofline step time, AF split",
                       description="Plan a recipe on a GPU node without training or allocating weights: every stage's model is "
                       "built on the meta device (exact parameter counts by role, active parameters per token, bytes of weights "
                       "by storage, gradients and optimizer state), activations and buffers are modelled, and a roofline gives "
                       "step time, MFU and tokens/s. For the last stage, every split of the GPUs into attention and expert ranks "
                       "(attention/expert disaggregation) is compared with the co-located expert-parallel layout. Growth's peak per "
                       "rank is placed where train.grow_on: auto runs it (the GPU, or the host when over the GPU's budget). Exit 1 "
                       "if a stage, or its growth, does not fit with 10% headroom.")
    p.add_argument("recipe", type=Path, help="recipe YAML file")
    p.add_argument("--hardware", default="h100-80gb", metavar="PRESET",
                   help="a100-80gb, h100-80gb (default), h200-141gb or b200 (vendor datasheet figures)")
    p.add_argument("--gpus", type=int, default=None, metavar="N", help="GPUs per node (default 8)")
    p.add_argument("--nodes", type=int, default=None, metavar="N", help="nodes (default 1); experts shard over all GPUs")
    p.add_argument("--peak-tflops", type=float, default=None, help="override the preset's dense BF16 TFLOP/s per GPU")
    p.add_argument("--hbm-gbps", type=float, default=None, help="override the HBM bandwidth, GB/s per GPU")
    p.add_argument("--nvlink-gbps", type=float, default=None, help="override the NVLink bandwidth, GB/s per GPU and direction")
    p.add_argument("--nic-gbps", type=float, default=None, help="override the inter-node bandwidth, GB/s per GPU and direction")
    p.add_argument("--capacity-gb", type=float, default=None, help="override the memory per GPU, GB (1e9 bytes)")
    p.add_argument("--host-memory-gb", type=float, default=None,
                   help="override the node's host memory, GB (default 2000, a DGX's): where growth over the GPU's memory runs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a recipe field")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--measured", type=Path, default=None, metavar="RUN_DIR",
                   help="a run of this recipe in an AF layout (distributed.layout: af, as many processes as --gpus x --nodes): "
                   "print the planner's step time and each side's waiting share for its split and schedule next to the "
                   "run's measured ones (its metrics.jsonl, the last stage)")

    p = sub.add_parser("inspect", help="show a run's or checkpoint's stage, step, tokens, parameters and growth history",
                       description="Show where a run stands: stage, step, tokens, parameter counts, and each growth "
                       "transition with its invariance report. Reads only the checkpoint's meta.json.")
    p.add_argument("path", type=Path, help="run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")

    p = sub.add_parser("plot", help="draw runs' training and held-out loss against tokens and counted FLOPs (PNG)",
                       description="Draw one figure of the runs' training and held-out loss against tokens seen and against "
                       "counted training FLOPs (metrics.jsonl's `flops`: forward + backward matmul and attention FLOPs at each "
                       "step's shape), with each stage boundary marked and labelled with its growth operators and the Δloss "
                       "their invariance checks measured. Needs matplotlib: pip install 'growtrain[plot]'.")
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN_DIR", help="run directories (growtrain run --out DIR)")
    p.add_argument("--out", type=Path, default=Path("loss.png"), metavar="FILE.png", help="image to write (default loss.png)")
    p.add_argument("--label", dest="labels", action="append", default=None, metavar="NAME",
                   help="legend name of each run, in order (repeat once per RUN_DIR; default: the folder names)")

    p = sub.add_parser("generate", help="sample text from a checkpoint", description=(
        "Sample a continuation of --prompt from a checkpoint, printed as it is sampled (KV cache). Beyond the context the "
        "model was trained at (its largest seq_len) the context slides: when it is full it restarts from its last half."
    ))
    p.add_argument("checkpoint", type=Path, help="run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("--prompt", required=True, help="text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature; 0 = greedy (default 0.8)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (default 50)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text (default 0)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole context for every token (slow; the reference path)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where the model runs (auto: cuda where available, else cpu); the same seed gives the same draws")

    p = sub.add_parser("export-adapters", help="write a checkpoint's LoRA adapters in peft's layout (adapter_config.json + safetensors)",
                       description="Write the LoRA adapters of a checkpoint (the NF4 experts' per-expert LoRA pairs, as peft "
                       "target_parameters LoRA on experts.w_gate/w_up/w_down, and any peft LoRA on dense layers) as "
                       "adapter_config.json + adapter_model.safetensors, loadable with peft's PeftModel.from_pretrained onto the "
                       "base model (full-precision experts holding the dequantized NF4 bases; --base writes it too).")
    p.add_argument("checkpoint", type=Path, help="run directory (its newest complete checkpoint) or a checkpoint directory")
    p.add_argument("out_dir", type=Path, help="directory to write the adapter files into")
    p.add_argument("--base", action="store_true", help="also write the base model (base_model.safetensors + base_model_config.json)")

    p = sub.add_parser("export-hf", help="write a checkpoint as a folder transformers loads (AutoModelForCausalLM, trust_remote_code)",
                       description="Write the model of a checkpoint as a folder that transformers loads with "
                       "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) and AutoTokenizer.from_pretrained(DIR), "
                       "with only torch and transformers installed: config.json, the remote-code files configuration_growlm.py and "
                       "modeling_growlm.py, sharded safetensors with an index, tokenizer files, generation_config.json and a model "
                       "card (README.md). NF4 experts and peft LoRA are merged into the weights (dequantize(base) + scale * B @ A). "
                       "Any checkpoint the trainer writes exports: one process, expert-parallel or AF shards, NF4 + LoRA (optimizer "
                       "state is not exported). Tensors are streamed a chunk at a time: memory stays flat whatever the model size. "
                       "The folder appears only when complete.",
                       epilog="Evaluate it offline with lm-evaluation-harness (pip install 'growtrain[eval]'); the tasks are in the\n"
                       "repository's evals/ folder, installed as growtrain.evals (the command printed at the end names its path):\n"
                       "  lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True --include_path evals \\\n"
                       "          --tasks growtrain_heldout_ppl,growtrain_facts_mc --device cpu",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="run directory (its newest intact checkpoint) or a checkpoint directory")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write (new or empty; see --overwrite)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the exported weights (default float32: the trained function; the router stays float32)")
    p.add_argument("--experts", choices=["merged", "nf4"], default="merged",
                   help="NF4 experts: merged (default) into full-precision weights, dequantize(base) + scale * B @ A; nf4 is refused "
                   "with the reason (no transformers quantizer reads stacked NF4 experts with per-expert LoRA)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE", help="largest safetensors file (default 5GB; e.g. 500MB, 2GiB)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (only once the new export is complete)")

    p = sub.add_parser("prepare-data", help="tokenize a source once into memory-mapped token shards (then data.source: DIR)",
                       description="Read SOURCE (anything data.source reads: builtin:pydoc_topics, builtin:python_stdlib, a "
                       "local text/jsonl/parquet file or folder, a hub dataset) as a stream, split it train / held-out by a hash "
                       "of each document, shuffle the train documents by --seed (within buffers of --buffer-mb), tokenize in "
                       "worker processes and write fixed-size token shards (uint16 where the vocabulary fits, else uint32) with "
                       "manifest.json last. Train on the folder with data.source: DIR (memory-mapped, each rank reads its own "
                       "rows). An interrupted prepare leaves no manifest; running it again starts over cleanly.")
    p.add_argument("source", help="what to read (as data.source; a relative path is relative to the working directory)")
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="folder to write (new or empty; see --overwrite)")
    p.add_argument("--tokenizer", default="byte", metavar="byte|PATH",
                   help="'byte' (default) or a tokenizer.json (or its folder); recipes training on DIR must name the same one "
                   "(a copy is written to DIR/tokenizer.json, so data.tokenizer: DIR works)")
    p.add_argument("--eval-fraction", type=float, default=0.05, metavar="F", help="share of documents held out (default 0.05)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed of the train documents (default 0; use the recipe's "
                   "seed to get exactly the tokens that reading the source at start gives)")
    p.add_argument("--format", choices=["auto", "text", "jsonl", "parquet"], default="auto", help="format of local files (default: by extension)")
    p.add_argument("--text-field", default="text", help="column holding the text in jsonl, parquet and hub data (default text)")
    p.add_argument("--split", default="train", help="split of a hub dataset (default train)")
    p.add_argument("--max-bytes", type=int, default=0, help="stop after this many bytes of text (default 0: all)")
    p.add_argument("--shard-tokens", type=int, default=1 << 27, metavar="N", help="tokens per shard (default 134,217,728)")
    p.add_argument("--dtype", choices=["auto", "uint16", "uint32"], default="auto",
                   help="token id type of the shards (default auto: uint16 where the vocabulary fits)")
    p.add_argument("--workers", type=int, default=0, metavar="N", help="tokenizer processes (default 0: one per CPU core)")
    p.add_argument("--buffer-mb", type=float, default=256.0, metavar="MB",
                   help="text split and shuffled together (default 256); a source that fits one buffer is shuffled whole")
    p.add_argument("--overwrite", action="store_true", help="replace prepared data already in --out (its manifest and shards are removed first)")

    p = sub.add_parser("check-data", help="verify a prepared folder's shards against its manifest (sizes and sha256)",
                       description="Read every shard of a folder written by prepare-data and compare its size and sha256 with "
                       "manifest.json. Training checks only sizes at start (reading 100s of GB at every resume is too slow); "
                       "run this after copying prepared data between machines. Exit 0 if all match, 2 otherwise.")
    p.add_argument("path", type=Path, help="prepared data folder")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt as exc:
        # `run` raises train.Interrupted, saying what is on disk; other commands have nothing to resume.
        print(f"\ninterrupted; {exc}" if str(exc) else "\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `growtrain print-config r.yaml | head`: the reader left; silence the exit-time flush too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:  # noqa: BLE001 — user-facing errors become messages, bugs keep their traceback
        code = _user_error_code(exc)
        if code is None:
            raise
        rank = f"[rank {os.environ['RANK']}] " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
        # One write: under torchrun every rank reports here at once, and with PYTHONUNBUFFERED a
        # print() writes its text and its newline apart, so two ranks' lines could run together.
        sys.stderr.write(f"{rank}error: {_message(exc)}\n")
        sys.stderr.flush()
        return code


# Errors of the machine, not of growtrain: the path given, its permissions, the disk.
ENVIRONMENT_ERRNOS = {
    errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST, errno.EISDIR,
    errno.ENAMETOOLONG, errno.EFBIG, errno.ENOENT,
}


def environment_error(exc: BaseException) -> OSError | None:
    """The OSError of the machine behind `exc` (itself, or what it was raised from), if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in ENVIRONMENT_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _message(exc: BaseException) -> str:
    env = environment_error(exc)
    if env is None:
        return str(exc)
    where = f": {env.filename}" if env.filename else ""
    hint = {
        errno.ENOSPC: "; free some space (or choose another --out), then run the same command: it resumes from the last checkpoint",
        errno.EDQUOT: "; the disk quota is used up: free some space, then run the same command",
        errno.EROFS: "; that file system is read-only: choose another path",
        errno.EACCES: "; no permission there: choose another path",
        errno.ENOTDIR: "; a part of that path is a file, not a folder: choose another path",
        errno.EEXIST: "; a file of that name is in the way: choose another path",
    }.get(env.errno, "")
    context = f"{exc}; " if env is not exc and not isinstance(exc, OSError) else ""
    return f"{context}{env.strerror or env}{where}{hint}"


def _user_error_code(exc: Exception) -> int | None:
    from growtrain.checkpoint.store import CheckpointError
    from growtrain.data.corpus import DataError
    from growtrain.recipe import RecipeError
    from growtrain.stages import GrowthCheckFailed

    from growtrain.checkpoint.run_lock import RunDirLocked

    if isinstance(exc, (RecipeError, DataError, CheckpointError, RunDirLocked)):
        return 2
    if environment_error(exc) is not None:
        return 2
    export = sys.modules.get("growtrain.hf.adapters")  # loaded by export-adapters and export-hf only
    if export is not None and isinstance(exc, export.ExportError):
        return 2
    plot = sys.modules.get("growtrain.plot")  # loaded by `plot`
    if plot is not None and isinstance(exc, plot.PlotError):
        return 2
    planning = sys.modules.get("growtrain.planning")  # loaded by `plan`
    if planning is not None and isinstance(exc, planning.PlanError):
        return 2
    if isinstance(exc, GrowthCheckFailed):
        return 3
    distributed = sys.modules.get("growtrain.parallel.distributed")  # loaded by `run`
    if distributed is not None and isinstance(exc, distributed.PeerFailed):
        return 5
    from growtrain.runtime.health import TrainingDiverged

    if isinstance(exc, TrainingDiverged):
        return 4
    return None


def cmd_run(args) -> int:
    from growtrain.recipe import load_recipe
    from growtrain.train import run

    recipe = load_recipe(args.recipe, args.overrides)
    out = args.out or Path("runs") / recipe.name
    result = run(recipe, out, args.resume)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone talks
        print(f"run directory: {result.run_dir}  (growtrain inspect {result.run_dir})")
    return 0


def cmd_validate(args) -> int:
    from growtrain.recipe import RecipeError, load_recipe

    try:
        recipe = load_recipe(args.recipe, args.overrides)
    except RecipeError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    from growtrain.stages import plan_stage_models

    if args.world_size < 1:
        print(f"error: --world-size must be >= 1, got {args.world_size}", file=sys.stderr)
        return 2
    shapes = plan_stage_models(recipe.model, [s.grow for s in recipe.stages])
    if args.world_size > 1:
        from growtrain.parallel.distributed import resolve_attention_ranks, world_size_problems

        try:
            recipe, chosen = resolve_attention_ranks(recipe, shapes, args.world_size)
        except RecipeError as exc:
            print(str(exc), file=sys.stderr)
            return 2
        if chosen:
            print(chosen)
        problems = world_size_problems(recipe, shapes, args.world_size)
        if problems:
            print(str(RecipeError(problems, f"{args.recipe} over {args.world_size} processes")), file=sys.stderr)
            return 2
    over = f" over {args.world_size} processes" if args.world_size > 1 else ""
    if args.world_size > 1 and recipe.distributed.layout == "af":
        A = recipe.distributed.attention_ranks
        over += f" (AF layout: {A} attention + {args.world_size - A} expert ranks)"
    sched = recipe.schedule
    lr_curve = (
        f"run-wide {sched.kind} schedule (warmup {sched.warmup_steps} steps, floor {sched.min_lr_ratio:g} x optimizer.lr)"
        if sched.run_wide
        else "per-stage LR schedules"
    )
    print(f"{args.recipe}: ok{over} — {len(recipe.stages)} stage(s), {sum(s.steps for s in recipe.stages):,} steps, {lr_curve}")
    for i, (stage, shape) in enumerate(zip(recipe.stages, shapes)):
        moe = f", MoE {shape.moe.num_experts} experts top-{shape.moe.top_k} in {len(shape.moe_layers)} layer(s)" if shape.moe else ""
        lr = f"lr {recipe.lr(i, 0):.2e} -> {recipe.lr(i, stage.steps - 1):.2e}"
        fresh = f"; fresh: {stage.fresh.describe()}" if not stage.fresh.is_default else ""
        print(f"  {stage.name}: {shape.n_layers} blocks, d_model {shape.d_model}{moe}; {stage.steps} steps, {lr}{fresh}")
    return 0


def cmd_print_config(args) -> int:
    from growtrain.recipe import dump_yaml, load_recipe

    print(dump_yaml(load_recipe(args.recipe, args.overrides)), end="")
    return 0


def cmd_schema(args) -> int:
    from growtrain.recipe import schema_markdown

    print(schema_markdown())
    return 0


def cmd_inspect(args) -> int:
    from growtrain.inspect import inspect_report

    report = inspect_report(args.path)
    if args.json:
        print(json.dumps(report))
        return 0
    from growtrain.inspect import format_report

    print(format_report(report))
    return 0


def cmd_plot(args) -> int:
    from growtrain.plot import plot_runs

    out = plot_runs(args.runs, args.out, args.labels)
    print(f"wrote {out} ({len(args.runs)} run(s))")
    return 0


def cmd_generate(args) -> int:
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--temperature", args.temperature), ("--top-k", args.top_k)):
        if value < 0:
            print(f"error: {flag} must be >= 0, got {value}", file=sys.stderr)
            return 2
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but no CUDA device is available here; use auto or cpu", file=sys.stderr)
        return 2
    from growtrain.generate import generate_from_checkpoint, write_flushed

    # Streamed: the prompt once the model has loaded, then each piece of text as it is sampled;
    # the timing line goes to stderr after the text's newline.
    timing: list[str] = []
    generate_from_checkpoint(
        args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed,
        stream=write_flushed, use_cache=not args.no_cache, report=timing.append, device=args.device,
    )
    print(flush=True)
    for line in timing:
        print(line, file=sys.stderr)
    return 0


def cmd_export_adapters(args) -> int:
    from growtrain.hf.adapters import export_adapters

    summary = export_adapters(args.checkpoint, args.out_dir, with_base=args.base)
    print(
        f"wrote {summary['adapter_parameters']:,} adapter parameters ({summary['adapter_tensors']} tensors) from "
        f"{summary['checkpoint']} to {summary['out_dir']}"
    )
    return 0


def cmd_export_hf(args) -> int:
    from growtrain.hf.export import export_hf

    summary = export_hf(args.checkpoint, args.out, args.dtype, args.experts, args.max_shard_size, args.overwrite)
    evals = Path(__import__("growtrain.evals").evals.__file__).parent
    remote = summary["remote_code"]
    kind = " (remote code)" if remote else " (transformers' own class)"
    print(
        f"exported {summary['checkpoint']} to {summary['out']} as {summary['architecture']}{kind}: "
        f"{summary['tensors']} tensors, {summary['bytes'] / 1e9:.3f} GB "
        f"{summary['dtype']} in {len(summary['files'])} file(s), {summary['seconds']:.1f} s\n"
        f"load it:     AutoModelForCausalLM.from_pretrained({str(summary['out'])!r}{', trust_remote_code=True' if remote else ''})\n"
        f"evaluate it: lm_eval --model hf --model_args pretrained={summary['out']}{',trust_remote_code=True' if remote else ''} "
        f"--include_path {evals} --tasks growtrain_heldout_ppl,growtrain_facts_mc --device cpu"
    )
    return 0


def cmd_plan(args) -> int:
    from growtrain.planning import format_plan, get_hardware, plan_recipe
    from growtrain.recipe import load_recipe

    for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes)):
        if value is not None and value < 1:
            print(f"error: {flag} must be >= 1, got {value}", file=sys.stderr)
            return 2
    hw = get_hardware(
        args.hardware, gpus_per_node=args.gpus, nodes=args.nodes, peak_tflops=args.peak_tflops, hbm_gbps=args.hbm_gbps,
        nvlink_gbps=args.nvlink_gbps, nic_gbps=args.nic_gbps, capacity_gb=args.capacity_gb,
        host_memory_gb=args.host_memory_gb,
    )
    result = plan_recipe(load_recipe(args.recipe, args.overrides), hw)
    comparison = _af_measured(result, args.measured) if args.measured is not None else None
    if args.json:
        print(json.dumps(result.to_dict() | ({"af_measured": comparison} if comparison else {})))
    else:
        print(format_plan(result))
        if comparison:
            from growtrain.planning.af_measured import format_comparison

            print("\n" + format_comparison(comparison))
    return 0 if result.fits else 1


def _af_measured(plan, run_dir: Path) -> dict:
    """The plan's AF split of the run's layout against the run (planning/af_measured.py)."""
    import yaml

    from growtrain.planning import PlanError
    from growtrain.planning.af_measured import compare
    from growtrain.runtime.tracking import MetricsFile

    recipe_file, metrics = run_dir / "recipe.yaml", run_dir / "metrics.jsonl"
    if not recipe_file.is_file() or not metrics.is_file():
        raise PlanError(f"--measured {run_dir}: not a run directory (no recipe.yaml and metrics.jsonl)")
    dist_cfg = (yaml.safe_load(recipe_file.read_text()) or {}).get("distributed") or {}
    if dist_cfg.get("layout") != "af":
        raise PlanError(f"--measured {run_dir}: the run was not trained in an AF layout (distributed.layout: {dist_cfg.get('layout', 'colocated')})")
    if not plan.af.applicable:
        raise PlanError(f"--measured: the plan has no AF split to compare ({plan.af.reason})")
    A = dist_cfg.get("attention_ranks", 1)
    split = next((sp for sp in plan.af.splits if sp.attention_gpus == A), None)
    if split is None:
        raise PlanError(f"--measured: the plan's {plan.af.gpus} GPUs have no split with {A} attention ranks (give --gpus the run's process count)")
    return compare(split, dist_cfg.get("af_schedule", "sequential"), MetricsFile(metrics).read(), plan.af.stage)


def cmd_prepare_data(args) -> int:
    from growtrain.data.corpus import resolve_source_path, resolve_tokenizer_path
    from growtrain.data.prepare import PrepareOptions, prepare_data

    cwd = Path.cwd()
    opts = PrepareOptions(
        source=resolve_source_path(args.source, cwd), out=args.out, tokenizer=resolve_tokenizer_path(args.tokenizer, cwd),
        eval_fraction=args.eval_fraction, seed=args.seed, format=args.format, text_field=args.text_field, split=args.split,
        max_bytes=args.max_bytes, shard_tokens=args.shard_tokens, dtype=args.dtype, workers=args.workers,
        buffer_bytes=max(1, int(args.buffer_mb * 2**20)), overwrite=args.overwrite,
    )
    m = prepare_data(opts)
    n_train, n_eval = sum(s.tokens for s in m.train), sum(s.tokens for s in m.eval)
    print(
        f"wrote {args.out}: {n_train:,} train tokens in {len(m.train)} shard(s), {n_eval:,} held-out tokens, "
        f"{m.documents['train'] + m.documents['eval']:,} documents, {m.dtype}, tokenizer {m.tokenizer['name']}\n"
        f"train on it with: --set data.source={args.out}"
        + ("" if m.tokenizer["spec"] == "byte" else f" --set data.tokenizer={args.out}")
    )
    return 0


def cmd_check_data(args) -> int:
    from growtrain.data.shards import read_manifest, verify_shards

    manifest = read_manifest(args.path)

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(f"\rcheck-data: {done / 1e6:,.0f} / {total / 1e6:,.0f} MB")

    problems = verify_shards(args.path, manifest, progress)
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if problems:
        print(f"error: {len(problems)} shard(s) of {args.path} do not match its manifest:", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 2
    n = len(manifest.train) + len(manifest.eval)
    print(f"{args.path}: ok — {n} shard(s) match the manifest (fingerprint {manifest.fingerprint})")
    return 0


COMMANDS = {
    "run": cmd_run,
    "validate": cmd_validate,
    "print-config": cmd_print_config,
    "schema": cmd_schema,
    "inspect": cmd_inspect,
    "generate": cmd_generate,
    "plot": cmd_plot,
    "export-adapters": cmd_export_adapters,
    "export-hf": cmd_export_hf,
    "plan": cmd_plan,
    "prepare-data": cmd_prepare_data,
    "check-data": cmd_check_data,
}


if __name__ == "__main__":
    sys.exit(main())
