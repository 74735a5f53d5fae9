"""Training memory does not grow with the corpus on prepared data (issue 17).

Builds a text corpus of ~10M and of ~200M tokens (the built-in corpora, python_stdlib and
pydoc_topics, repeated), prepares each with `growtrain prepare-data` (2 worker processes), and
trains the first two stages of the tiny recipe (dense, then upcycled to MoE; a few steps each) on
each as a real `growtrain run`. Reports the peak RSS of each run (the kernel's ru_maxrss of the
training process), the prepare throughput, the loader's throughput (TokenStream batches of the
tiny recipe's shape, read from the memory-mapped shards) and the tokens/s the training consumed.
With `--baseline` it also trains once on each text corpus read into memory at start, the path
prepared data replaces, for comparison.

    python benchmarks/data_memory.py [--json] [--small-tokens N] [--large-tokens N] [--steps N] [--baseline] [--bpe VOCAB]

Targets: rss_large_mb <= 1.10 x rss_small_mb; loader_tokens_per_s >= 20 x train_tokens_per_s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from growtrain.data.corpus import BUILTIN_SOURCES  # noqa: E402

FILE_BYTES = 4 << 20  # text per file of the built corpus


def build_text(root: Path, target_bytes: int) -> int:
    """jsonl files under `root` of the built-in corpora, repeated to ~target_bytes; bytes written."""
    root.mkdir(parents=True)
    docs = [d for name in ("builtin:python_stdlib", "builtin:pydoc_topics") for d in BUILTIN_SOURCES[name]() if d]
    written, index, batch, size = 0, 0, [], 0
    while written < target_bytes:
        for doc in docs:
            raw = doc.encode("utf-8")
            batch.append(raw)
            size += len(raw)
            written += len(raw)
            if size >= FILE_BYTES or written >= target_bytes:
                # jsonl, one document per line, so the documents stay the corpora's own.
                (root / f"part-{index:05d}.jsonl").write_text("".join(json.dumps({"text": d.decode("utf-8")}) + "\n" for d in batch))
                index, batch, size = index + 1, [], 0
            if written >= target_bytes:
                break
    return written


def child_peak_mb(cmd: list[str], env: dict) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MB, stdout) of a command run as a child (ru_maxrss via wait4)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # communicate() would reap the child; read the pipes by hand and reap with wait4 for its rusage.
    out_chunks, err_chunks = [], []
    import threading

    def drain(stream, sink):
        sink.append(stream.read())

    threads = [threading.Thread(target=drain, args=(proc.stdout, out_chunks)), threading.Thread(target=drain, args=(proc.stderr, err_chunks))]
    for t in threads:
        t.start()
    _, status, usage = os.wait4(proc.pid, 0)
    for t in threads:
        t.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{''.join(err_chunks)[-3000:]}")
    return wall, usage.ru_maxrss / 1024, "".join(out_chunks)  # ru_maxrss is in KiB on Linux


def short_recipe(source: str, steps: int) -> dict:
    raw = yaml.safe_load((REPO / "recipes" / "tiny.yaml").read_text())
    raw["name"] = "data-memory"
    raw["data"] = {"source": source, "tokenizer": "byte", "eval_fraction": 0.05}
    raw["stages"] = raw["stages"][:2]
    for stage in raw["stages"]:
        stage["steps"] = steps
        stage.get("schedule", {}).pop("warmup_steps", None)
    if "schedule" in raw:  # the run-wide schedule's warmup would outlast a few steps
        raw["schedule"]["warmup_steps"] = 0
    raw["train"] = {**raw.get("train", {}), "log_every": 1000, "eval_every": 0, "eval_batches": 1}
    raw["tracking"] = {"wandb": {"mode": "disabled"}, "progress_bar": False}
    return raw


def train_bpe(text: Path, out: Path, vocab: int) -> Path:
    """A byte-level BPE tokenizer.json of `vocab` ids trained on the jsonl files under `text`."""
    import tokenizers

    def lines():
        for path in sorted(text.glob("*.jsonl")):
            for line in path.read_text(encoding="utf-8").splitlines():
                yield json.loads(line)["text"]

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(lines(), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def loader_tokens_per_s(prepared: Path, batch_size: int, seq_len: int, seconds: float = 2.0) -> float:
    from growtrain.data.corpus import DataConfig, TokenStream, load_corpus

    corpus = load_corpus(DataConfig(source=str(prepared)), seed=0)
    stream = TokenStream(corpus.train, 0)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        stream.next_batch(batch_size, seq_len)
        n += batch_size * seq_len
    return n / (time.perf_counter() - t0)


def train_tokens_per_s(run_dir: Path) -> float:
    """The median tokens/s of the run's fastest stage (the most the loader must keep up with)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    by_stage: dict[str, list[float]] = {}
    for r in rows[1:]:  # the first step carries start-up
        by_stage.setdefault(r["stage"], []).append(r["tokens_per_s"])
    return max(statistics.median(v) for v in by_stage.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    ap.add_argument("--small-tokens", type=float, default=10e6, help="tokens of the small corpus (default 1e7)")
    ap.add_argument("--large-tokens", type=float, default=200e6, help="tokens of the large corpus (default 2e8)")
    ap.add_argument("--steps", type=int, default=8, help="steps per stage of the training runs (default 8)")
    ap.add_argument("--baseline", action="store_true", help="also train on each text corpus read into memory at start")
    ap.add_argument("--bpe", type=int, default=0, metavar="VOCAB",
                    help="also prepare the small corpus with a byte-level BPE of VOCAB ids trained on it (the prepare "
                    "throughput of a real tokenizer; 0: skip, the default)")
    args = ap.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "WANDB_SILENT": "true"}
    growtrain = [sys.executable, "-m", "growtrain"]
    result: dict = {}
    with tempfile.TemporaryDirectory(prefix="data-memory-") as tmp:
        tmp = Path(tmp)
        for size, target in (("small", args.small_tokens), ("large", args.large_tokens)):
            text = tmp / f"text-{size}"
            # Byte tokenizer: one token per byte (plus one EOS per document).
            build_text(text, int(target))
            prepared = tmp / f"prepared-{size}"
            wall, _, _ = child_peak_mb([*growtrain, "prepare-data", str(text), "--out", str(prepared), "--workers", "2"], env)
            manifest = json.loads((prepared / "manifest.json").read_text())
            tokens = sum(s["tokens"] for split in ("train", "eval") for s in manifest[split])
            result[f"tokens_{size}"] = tokens
            result[f"prepare_s_{size}"] = round(wall, 1)
            result[f"prepare_tokens_per_s_{size}"] = tokens / wall
            for kind, source in (("prepared", prepared), *((("memory", text),) if args.baseline else ())):
                recipe = tmp / f"{kind}-{size}.yaml"
                recipe.write_text(yaml.safe_dump(short_recipe(str(source), args.steps), sort_keys=False))
                run_dir = tmp / f"run-{kind}-{size}"
                wall, peak, _ = child_peak_mb([*growtrain, "run", str(recipe), "--out", str(run_dir)], env)
                key = f"rss_{size}_mb" if kind == "prepared" else f"rss_memory_{size}_mb"
                result[key] = round(peak, 1)
                result[f"run_s_{kind}_{size}"] = round(wall, 1)
                if kind == "prepared" and size == "small":
                    result["train_tokens_per_s"] = train_tokens_per_s(run_dir)
        if args.bpe:
            tok = train_bpe(tmp / "text-small", tmp / "bpe", args.bpe)
            for workers in (1, 2):
                wall, _, _ = child_peak_mb([*growtrain, "prepare-data", str(tmp / "text-small"), "--out", str(tmp / f"bpe-{workers}"),
                                            "--tokenizer", str(tok), "--workers", str(workers)], env)
                manifest = json.loads((tmp / f"bpe-{workers}" / "manifest.json").read_text())
                tokens = sum(s["tokens"] for split in ("train", "eval") for s in manifest[split])
                result[f"prepare_tokens_per_s_bpe_{workers}w"] = tokens / wall
                result["tokens_small_bpe"] = tokens
        stage = short_recipe("", 1)["stages"][0]
        result["loader_tokens_per_s"] = loader_tokens_per_s(tmp / "prepared-large", stage["batch_size"], stage["seq_len"])
    result["prepare_tokens_per_s"] = result["prepare_tokens_per_s_large"]
    result["rss_growth"] = result["rss_large_mb"] / result["rss_small_mb"] - 1
    result["loader_over_train"] = result["loader_tokens_per_s"] / result["train_tokens_per_s"]
    result["targets_met"] = result["rss_growth"] <= 0.10 and result["loader_over_train"] >= 20
    if args.json:
        print(json.dumps(result))
        return 0 if result["targets_met"] else 1
    print(f"prepared data, peak RSS of a {2 * args.steps}-step run of the tiny recipe's first two stages (2 cores)")
    print(f"{'corpus':<8}{'tokens':>14}{'prepare s':>11}{'prepare tok/s':>15}{'RSS MB':>9}" + (f"{'RSS in memory MB':>18}" if args.baseline else ""))
    for size in ("small", "large"):
        line = (f"{size:<8}{result[f'tokens_{size}']:>14,}{result[f'prepare_s_{size}']:>11.1f}"
                f"{result[f'prepare_tokens_per_s_{size}']:>15,.0f}{result[f'rss_{size}_mb']:>9,.0f}")
        if args.baseline:
            line += f"{result[f'rss_memory_{size}_mb']:>18,.0f}"
        print(line)
    if args.bpe:
        print(f"BPE ({args.bpe:,} ids) prepare of the small corpus: {result['tokens_small_bpe']:,} tokens, "
              f"{result['prepare_tokens_per_s_bpe_1w']:,.0f} tok/s with 1 worker, {result['prepare_tokens_per_s_bpe_2w']:,.0f} with 2")
    print(f"RSS growth small -> large: {result['rss_growth']:+.1%} (target <= +10%)")
    print(f"loader {result['loader_tokens_per_s']:,.0f} tok/s vs training {result['train_tokens_per_s']:,.0f} tok/s: "
          f"{result['loader_over_train']:,.0f}x (target >= 20x)")
    return 0 if result["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
