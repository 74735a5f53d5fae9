"""`growtrain export-hf`: a checkpoint as a folder that transformers loads with
`AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` and `AutoTokenizer.from_pretrained(DIR)`,
with nothing but torch and transformers installed (DESIGN.md §16, interop).

What the folder holds:
- `config.json` (model_type `growlm`, auto_map to the two remote-code files), the self-contained
  `configuration_growlm.py` and `modeling_growlm.py` (copied from growtrain/hf/remote/);
- the weights as safetensors, sharded by --max-shard-size with `model.safetensors.index.json`;
  NF4 experts merged, dequantize(base) + scale * B @ A, and peft LoRA on dense layers merged,
  base + scale * B @ A, in the requested dtype (the router stays float32);
- `tokenizer.json` + `tokenizer_config.json` (the byte tokenizer rebuilt as an equivalent
  byte-level BPE with no merges; a tokenizer file copied as trained), `generation_config.json`;
- `README.md`, a model card written from the checkpoint's meta data.

Memory: the export never holds the model. Every output tensor is produced in chunks of rows along
its first dimension (experts of a stacked expert tensor, rows of a matrix), each at most
`hf_common.CHUNK_BYTES` in float32, read from the checkpoint with plain file reads (no memory map that
would count the whole file as resident) and written straight into a safetensors file whose header
is laid out beforehand. Peak memory is the interpreter plus a few chunks, whatever the model size.

Writes go to a temporary folder beside --out, renamed into place when complete: an interrupted or
failed export (a full disk included) leaves nothing that looks finished.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import time
from pathlib import Path
from typing import Callable

import torch

from growtrain.checkpoint.store import MODEL_FILE, CheckpointError, read_meta
from growtrain.checkpoint.durable import fsync_dir, fsync_file
from growtrain.model.expert_shards import expert_range, is_expert_tensor
from growtrain.hf.adapters import ExportError, base_config
from growtrain.hf.common import OutTensor, shape_config
from growtrain.hf.native import native_class, native_config, native_tensors
from growtrain.model.config import ModelConfig
from growtrain.model.nf4 import MATRICES

REMOTE_DIR = Path(__file__).parent / "remote"
REMOTE_FILES = ("configuration_growlm.py", "modeling_growlm.py")
MODEL_TYPE = "growlm"
ARCHITECTURE = "GrowLMForCausalLM"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
EXPERT_FORMATS = ("merged", "nf4")
BYTE_EOS_TOKEN = "<|endoftext|>"

# safetensors' dtype names (https://github.com/huggingface/safetensors, format section).
_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}

NF4_REFUSAL = (
    "--experts nf4 cannot be honoured: transformers loads 4-bit weights through bitsandbytes' Linear4bit, one module per "
    "[out, in] matrix with no adapter; growtrain's NF4 experts are stacked per layer ([experts, hidden, d_model] codes, each "
    "expert quantized on its own) with a LoRA pair per expert and matrix, which no transformers quantizer reads, and "
    "re-quantizing the merged weights would change the function. Export --experts merged (the default): exactly the "
    "trained function up to --dtype's rounding"
)


# ---------------------------------------------------------------------------------------------
# Reading a checkpoint a piece at a time


class SafetensorsFile:
    """A safetensors file read by explicit reads of the byte ranges asked for (rows along dim 0)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self.start = 8 + n
        self.entries = header

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        e = self.entries[name]
        dtype, shape = _ST_DTYPES[e["dtype"]], list(e["shape"])
        begin, end = e["data_offsets"]
        if lo is not None and shape:
            row = (end - begin) // max(shape[0], 1)
            begin, end = begin + lo * row, begin + hi * row
            shape[0] = hi - lo
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.start + begin)
            if f.readinto(buf.numpy()) != end - begin:
                raise CheckpointError(f"{self.path}: {name} is cut short")
        return buf.view(dtype).reshape(shape)


class CheckpointTensors:
    """The tensors of one checkpoint dir by name, read a range of rows at a time, whichever layout
    wrote it: one process (all in model.safetensors) or expert-parallel / AF ranks (routed experts
    in per-rank shard files, each holding a contiguous range of every layer's experts)."""

    def __init__(self, path: Path, meta: dict):
        self.path = Path(path)
        self.dense = SafetensorsFile(self.path / MODEL_FILE)
        saved = meta.get("expert_parallel") or {}
        self.shard_files = [self.path / f for f in saved.get("files", [])]
        self.expert_names: dict[str, tuple[int, ...]] = {}
        if self.shard_files:
            # Names and shapes from the first shard (each shard holds every expert tensor, its range of experts).
            first = self._shard_model(self.shard_files[0])
            size = len(self.shard_files)
            self.expert_names = {n: (t.shape[0] * size, *t.shape[1:]) for n, t in first.items()}
            del first

    @staticmethod
    def _shard_model(file: Path) -> dict[str, torch.Tensor]:
        try:
            return torch.load(file, weights_only=True, map_location="cpu", mmap=True)["model"]
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{file}: not a readable expert shard ({e})") from None

    def names(self) -> list[str]:
        return self.dense.names() + list(self.expert_names)

    def __contains__(self, name: str) -> bool:
        return name in self.dense.entries or name in self.expert_names

    def shape(self, name: str) -> tuple[int, ...]:
        return self.expert_names[name] if name in self.expert_names else self.dense.shape(name)

    def read(self, name: str, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        if name not in self.expert_names:
            return self.dense.read(name, lo, hi)
        total = self.expert_names[name][0]
        lo, hi = (0, total) if lo is None else (lo, hi)
        size, pieces = len(self.shard_files), []
        for rank, file in enumerate(self.shard_files):
            s_lo, s_hi = expert_range(total, rank, size)
            a, b = max(lo, s_lo), min(hi, s_hi)
            if a < b:
                # Loaded per read and dropped at once: the memory map goes with it, so the pages read
                # do not stay counted against the process.
                pieces.append(self._shard_model(file)[name][a - s_lo : b - s_lo].clone())
        return torch.cat(pieces)


# ---------------------------------------------------------------------------------------------
# What is written: growtrain's base-model tensors under transformers' names, produced by rows


def hf_name(name: str) -> str:
    """growtrain's state-dict name in GrowLMForCausalLM (everything but the head lives under `model.`)."""
    return name if name.startswith("lm_head.") else "model." + name


def _keeps_fp32(name: str) -> bool:
    """The router (weights and balance bias) is exported in float32 whatever --dtype says: the
    modeling file keeps it there (`_keep_in_fp32_modules`), so bfloat16 never flips a top-k."""
    return ".router." in name


def plan_tensors(cfg: ModelConfig, src: CheckpointTensors, dtype: torch.dtype) -> list[OutTensor]:
    """Every tensor of the base model (NF4 and LoRA merged), under growtrain's names, in GrowLM's
    state-dict order, each with how to make it;
    ExportError for a checkpoint tensor that nothing would write (a format this exporter does not know)."""
    from growtrain.model import GrowLM

    with torch.device("meta"):
        skeleton = GrowLM(base_config(cfg))
    used: set[str] = set()
    out = []
    for name, t in skeleton.state_dict().items():
        shape = tuple(t.shape)
        stem, _, kind = name.rpartition(".")
        if name in src:
            rows, parts = _read_rows(src, name), [name]
        elif kind == "weight" and f"{stem}.base_layer.weight" in src:
            rows, parts = _merged_dense_lora(cfg, src, name)
        elif kind == "bias" and f"{stem}.base_layer.bias" in src:  # a peft-wrapped Linear's bias: LoRA leaves it as it is
            rows, parts = _read_rows(src, f"{stem}.base_layer.bias"), [f"{stem}.base_layer.bias"]
        elif is_expert_tensor(name) and name.rsplit(".", 1)[-1] in MATRICES:
            rows, parts = _merged_nf4(cfg, src, name)
        else:
            raise ExportError(f"the checkpoint holds no tensor for {name} (nor LoRA or NF4 parts it is merged from)")
        if name in src and src.shape(name) != shape:
            raise ExportError(f"{name}: the checkpoint's tensor has shape {src.shape(name)}, its model config says {shape}")
        used.update(parts)
        out.append(OutTensor(name, shape, torch.float32 if _keeps_fp32(name) else dtype, rows))
    left = [n for n in src.names() if n not in used]
    if left:
        raise ExportError(f"the checkpoint holds tensors the export would drop: {', '.join(left[:5])}{' ...' if len(left) > 5 else ''}")
    return out


def _read_rows(src: CheckpointTensors, name: str) -> Callable[[int, int], torch.Tensor]:
    return lambda lo, hi: src.read(name, lo, hi) if src.shape(name) else src.read(name)


def _merged_dense_lora(cfg: ModelConfig, src: CheckpointTensors, name: str):
    """A peft-wrapped Linear's weight with its adapter merged: base + scale * B @ A (peft's own merge)."""
    stem = name[: -len("weight")]
    base, a, b = stem + "base_layer.weight", stem + "lora_A.default.weight", stem + "lora_B.default.weight"
    if a not in src or b not in src:
        raise ExportError(f"{name}: a peft base layer without its lora_A / lora_B")
    lora = cfg.dense_lora
    if lora is None:
        raise ExportError(f"{name}: peft LoRA tensors in a checkpoint whose model config has no dense_lora")
    scale = lora.scale
    A = src.read(a).float()  # [r, in]: small

    def rows(lo: int, hi: int) -> torch.Tensor:
        return src.read(base, lo, hi).float() + scale * (src.read(b, lo, hi).float() @ A)

    return rows, [base, a, b]


def _merged_nf4(cfg: ModelConfig, src: CheckpointTensors, name: str):
    """An NF4 expert matrix with its LoRA merged, expert by expert chunk: dequantize(base) + scale * B @ A,
    in the full-precision layout ([E, F, D] gate and up, [E, D, F] down)."""
    from growtrain.model.nf4 import dequantize_stack, state_stack

    prefix, m = name.rsplit(".", 1)
    prefix += "."
    moe = cfg.moe
    if moe is None or moe.expert_format != "nf4":
        raise ExportError(f"the checkpoint holds no tensor for {name}")
    parts = [n for n in src.names() if n.startswith(prefix + m + "_")]
    shared = {k: src.read(prefix + k) for k in ("quant_map", "nested_quant_map") if prefix + k in src}
    scale = moe.lora.scale

    def rows(lo: int, hi: int) -> torch.Tensor:
        state = dict(shared)
        for part in parts:
            key = part[len(prefix) :]
            if not key.endswith(("_lora_A", "_lora_B")):
                state[key] = src.read(part, lo, hi)
        stack = state_stack(m, state, moe.expert_hidden, cfg.d_model)
        w = dequantize_stack(stack)
        if m == "w_down":
            w = w.transpose(1, 2)
        A, B = src.read(f"{prefix}{m}_lora_A", lo, hi).float(), src.read(f"{prefix}{m}_lora_B", lo, hi).float()
        return w + scale * (B @ A)

    return rows, parts + [prefix + k for k in shared]


# ---------------------------------------------------------------------------------------------
# Writing safetensors a chunk at a time


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB', '1048576' -> bytes (GB = 10^9, GiB = 2^30, as transformers reads them)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ExportError(f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    number, unit = float(m.group(1)), (m.group(2) or "B").upper()
    powers = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    size = int(number * powers[unit])
    if size < 1:
        raise ExportError(f"--max-shard-size {text!r} must be at least one byte")
    return size


def shard_plan(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    """Tensors in order, cut into files of at most max_bytes (a tensor larger than that gets a file of its own)."""
    files: list[list[OutTensor]] = [[]]
    size = 0
    for t in tensors:
        if files[-1] and size + t.nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += t.nbytes
    return files


def write_safetensors(path: Path, tensors: list[OutTensor], on_bytes: Callable[[int], None] = lambda n: None) -> None:
    """One safetensors file, header first (offsets known from the shapes), then each tensor's chunks."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors:
            written = 0
            for chunk in t.chunks():
                data = chunk.reshape(-1).view(torch.uint8).numpy()
                f.write(data)
                written += data.nbytes
                on_bytes(data.nbytes)
            if written != t.nbytes:
                raise ExportError(f"{t.name}: wrote {written} bytes, its shape needs {t.nbytes}")
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------
# Config, tokenizer, generation config, model card


def hf_config(cfg: ModelConfig, dtype: str, max_positions: int, eos_id: int) -> dict:
    moe = cfg.moe
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "auto_map": {"AutoConfig": "configuration_growlm.GrowLMConfig", "AutoModelForCausalLM": f"modeling_growlm.{ARCHITECTURE}"},
        "block_type": cfg.block,
        "qkv_bias": cfg.qkv_bias,
        **shape_config(cfg, max_positions, eos_id),
        "intermediate_size": cfg.ffn_hidden,
        "moe_layers": list(cfg.moe_layers),
        "num_experts": moe.num_experts if moe else 0,
        "num_experts_per_tok": moe.top_k if moe else 0,
        "moe_intermediate_size": moe.expert_hidden if moe else 0,
        "router_score_func": moe.score_func if moe else "softmax",
        "shared_expert_intermediate_size": moe.shared_expert_hidden if moe else 0,
        "dtype": dtype,
        "torch_dtype": dtype,  # transformers 4 reads this name
    }


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet (GPT-2's): printable bytes stand for themselves, the others
    for the code points from 256 up, in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def byte_tokenizer_json() -> str:
    """growtrain's byte tokenizer (ids 0..255 the UTF-8 bytes, 256 EOS) as a `tokenizers` file:
    byte-level pre-tokenization without the word regex (the whole text is one word), a BPE with
    every byte as a token and no merge (so each byte stays its own token), id = the byte's value."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BYTE_EOS_TOKEN])
    if tok.token_to_id(BYTE_EOS_TOKEN) != 256:
        raise ExportError(f"the byte tokenizer's EOS came out as id {tok.token_to_id(BYTE_EOS_TOKEN)}, not 256")
    return tok.to_str()


def write_tokenizer(out: Path, ckpt: Path, meta: dict, max_positions: int) -> tuple[int, str]:
    """tokenizer.json + tokenizer_config.json; returns (eos id, eos token)."""
    from growtrain.data.tokenizer import checkpoint_tokenizer

    tokenizer = checkpoint_tokenizer(ckpt, meta)
    if tokenizer.name == "byte":
        (out / "tokenizer.json").write_text(byte_tokenizer_json())
        eos_token = BYTE_EOS_TOKEN
    else:
        shutil.copyfile(Path(tokenizer.name), out / "tokenizer.json")
        eos_token = tokenizer.eos_token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": eos_token,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": max_positions,
        # growtrain encodes and decodes text as it is: no space clean-up, no added special tokens.
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos_token, "pad_token": eos_token}, indent=2) + "\n")
    return tokenizer.eos_id, eos_token


def trained_context(meta: dict) -> int:
    """The longest sequence the model trained at (stages up to the checkpoint's)."""
    stages = meta["recipe"]["stages"][: meta.get("stage", 0) + 1]
    return max(int(s["seq_len"]) for s in stages)


def model_card(report: dict, meta: dict, settings: dict) -> str:
    """README.md of the export, from the checkpoint's inspect report."""
    m = report["model"]
    data = meta["recipe"].get("data", {})
    shape = f"{m['n_layers']} coupling blocks, d_model {m['d_model']}"
    if m["moe_layers"]:
        shape += f", {m['num_experts']} routed experts (top-{m['top_k']}) in blocks {m['moe_layers']}"
    lines = [
        "---",
        "library_name: transformers",
        "tags: [growtrain, mixture-of-experts, custom_code]",
        "---",
        f"# {meta['recipe'].get('name', 'growtrain model')}",
        "",
        f"Trained and grown by growtrain; exported by `growtrain export-hf` from `{report['checkpoint']}`.",
        "",
        f"- Model: {shape}; {report['weights_total']:,} weights.",
        f"- Training: stage {report['stage'] + 1}/{len(report['stages'])} '{report['stage_name']}', step {report['step']:,}, "
        f"{report['tokens']:,} tokens of `{data.get('source', '?')}` (tokenizer `{data.get('tokenizer', '?')}`).",
        f"- Loss at the checkpoint: training {_num(report['loss'])}, held-out {_num(report['eval_loss'])} (nats per token).",
        f"- Export: `{settings['architecture']}`, {settings['dtype']} weights, experts {settings['experts']}; context trained at "
        f"{settings['max_positions']} tokens.",
        "",
        "## Stages",
        "",
        "| stage | steps |",
        "|---|---|",
        *(f"| {s['name']} | {s['steps']} |" for s in report["stages"]),
        "",
        "## Growth history (invariance checks at each growth)",
        "",
    ]
    if report["transitions"]:
        lines += ["| stage | operator | exact | passed | max abs Δlogit | Δloss |", "|---|---|---|---|---|---|"]
        lines += [
            f"| {t['stage']} | {t['operator']} | {t['exact']} | {t['passed']} | {t['max_abs_dlogits']:.2e} | {t['loss_after'] - t['loss_before']:+.2e} |"
            for t in report["transitions"]
        ]
    else:
        lines.append("No growth yet.")
    trust = ", trust_remote_code=True" if settings["remote_code"] else ""
    code = ("The modeling code (`modeling_growlm.py`) needs torch and transformers only." if settings["remote_code"]
            else f"It is transformers' own `{settings['architecture']}`: no remote code, and engines that load that class load it.")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("PATH"{trust})',
        f'tokenizer = AutoTokenizer.from_pretrained("PATH"{trust})',
        'ids = tokenizer("The ", return_tensors="pt").input_ids',
        "print(tokenizer.decode(model.generate(ids, max_new_tokens=50, do_sample=False)[0]))",
        "```",
        "",
        f"{code} Evaluate with lm-evaluation-harness: `lm_eval --model hf --model_args pretrained=PATH{trust.replace(' ', '')} "
        "--tasks ...` (growtrain's `evals/` folder holds offline tasks).",
        "",
    ]
    return "\n".join(lines)


def _experts_note(cfg: ModelConfig) -> str:
    if cfg.moe is None:
        return "none (dense)"
    return "merged from NF4 bases + LoRA" if cfg.moe.expert_format == "nf4" else "in full precision as trained"


def _num(x) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) else "-"


# ---------------------------------------------------------------------------------------------
# The command


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; choose a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"--out {out} exists and is not empty; pass --overwrite to replace it")


def _sweep_leftovers(out: Path) -> None:
    """Remove the temporary folders of earlier exports to `out` that were killed (their process is gone)."""
    for p in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = p.name[len(out.name) + 2 :].rpartition("-")
        if kind in ("tmp", "old") and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _checkpoint(path: Path, log) -> Path:
    from growtrain.inspect import find_checkpoint

    log(f"checking {path} (the sha256 of every checkpoint file)")
    ckpt, problems, skipped = find_checkpoint(path)
    for s in skipped:
        log(f"checkpoint {Path(s['checkpoint']).name} is damaged ({'; '.join(s['problems'])}); falling back to {ckpt.name}")
    if problems:
        raise CheckpointError(f"checkpoint {ckpt} is damaged ({'; '.join(problems)}); export its run directory to use the newest intact one")
    return ckpt


def export_hf(
    checkpoint: Path,
    out: Path,
    dtype: str = "float32",
    experts: str = "merged",
    max_shard_size: str = "5GB",
    overwrite: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """`growtrain export-hf CHECKPOINT_OR_RUN_DIR --out DIR`; returns a summary."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if experts not in EXPERT_FORMATS:
        raise ExportError(f"--experts {experts!r}: choose one of {', '.join(EXPERT_FORMATS)}")
    max_bytes = parse_size(max_shard_size)
    out = Path(out)
    _prepare_out(out, overwrite)
    ckpt = _checkpoint(Path(checkpoint), log)
    meta = read_meta(ckpt)
    cfg = ModelConfig.from_dict(meta["model_config"])
    if experts == "nf4" and cfg.moe is not None and cfg.moe.expert_format == "nf4":
        raise ExportError(NF4_REFUSAL)
    if experts == "nf4":
        log("--experts nf4: this model has no NF4 experts; its weights are exported as trained")
    src = CheckpointTensors(ckpt, meta)
    tensors = plan_tensors(cfg, src, DTYPES[dtype])
    arch, why = native_class(cfg, any(bool(src.read(n).any()) for n in src.names() if n.endswith("router.balance_bias")))
    if arch is not None:
        tensors = native_tensors(arch, cfg, tensors)
        log(f"format: transformers' {arch} ({why}; no remote code)")
    else:
        tensors = [OutTensor(hf_name(t.name), t.shape, t.dtype, t.rows) for t in tensors]
        log(f"format: remote code, {ARCHITECTURE} ({why})")
    files = shard_plan(tensors, max_bytes)
    total = sum(t.nbytes for t in tensors)
    max_positions = trained_context(meta)

    out.parent.mkdir(parents=True, exist_ok=True)
    _sweep_leftovers(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    started = time.monotonic()
    try:
        eos_id, _ = write_tokenizer(tmp, ckpt, meta, max_positions)
        names = ["model.safetensors"] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
        done = [0]
        for name, group in zip(names, files):
            size = sum(t.nbytes for t in group)
            log(f"writing {name} ({len(group)} tensors, {size / 1e9:.2f} GB)")
            write_safetensors(tmp / name, group, on_bytes=lambda n: done.__setitem__(0, done[0] + n))
            log(f"  {done[0] / total:6.1%} of {total / 1e9:.2f} GB written, {time.monotonic() - started:.0f} s")
        if len(files) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": {t.name: n for n, g in zip(names, files) for t in g}}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        config = native_config(arch, cfg, dtype, max_positions, eos_id) if arch else hf_config(cfg, dtype, max_positions, eos_id)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {"eos_token_id": eos_id, "pad_token_id": eos_id, "do_sample": False}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        for f in REMOTE_FILES if arch is None else ():
            shutil.copyfile(REMOTE_DIR / f, tmp / f)
        from growtrain.inspect import checkpoint_report

        settings = {"dtype": dtype, "experts": _experts_note(cfg), "max_positions": max_positions, "architecture": arch or ARCHITECTURE, "remote_code": arch is None}
        (tmp / "README.md").write_text(model_card(checkpoint_report(ckpt), meta, settings))
        for f in tmp.iterdir():
            fsync_file(f)
        fsync_dir(tmp)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} while exporting (the partial export was removed; {out} is as it was)", str(out.parent)) from exc
        raise
    return {
        "checkpoint": str(ckpt),
        "out": str(out),
        "tensors": len(tensors),
        "architecture": arch or ARCHITECTURE,
        "remote_code": arch is None,
        "bytes": total,
        "files": names,
        "dtype": dtype,
        "seconds": time.monotonic() - started,
    }
