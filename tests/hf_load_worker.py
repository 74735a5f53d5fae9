"""Loads exported folders the way a user of transformers does, in a process where growtrain cannot
be imported (tests/test_export_hf.py runs it with `python -I` from a temporary folder).

Usage: python -I hf_load_worker.py JOB.json OUT.pt. JOB.json: {"exports": [{"dir", "dtype",
"tokens": [[...]], "prompt": [...], "new_tokens"}], "texts": [...]}. Writes per export: logits,
greedy generate with and without the cache, AutoTokenizer round trips; for the first export also
whether the plain `AutoTokenizer.from_pretrained(DIR)` (no trust_remote_code) loads.
"""

import importlib.abc
import json
import sys


class _NoGrowtrain(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "growtrain":
            raise ModuleNotFoundError(f"growtrain must not be importable here (asked for {name})")
        return None


sys.meta_path.insert(0, _NoGrowtrain())

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402


def main(job_file: str, out_file: str) -> None:
    job = json.loads(open(job_file).read())
    results = []
    for i, ex in enumerate(job["exports"]):
        dtype = getattr(torch, ex["dtype"])
        model = AutoModelForCausalLM.from_pretrained(ex["dir"], trust_remote_code=True, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(ex["dir"], trust_remote_code=True)
        with torch.no_grad():
            logits = model(torch.tensor(ex["tokens"])).logits.float()
            prompt = torch.tensor([ex["prompt"]])
            cached = model.generate(prompt, max_new_tokens=ex["new_tokens"], do_sample=False)[0].tolist()
            uncached = model.generate(prompt, max_new_tokens=ex["new_tokens"], do_sample=False, use_cache=False)[0].tolist()
        result = {
            "logits": logits,
            "generate_cached": cached,
            "generate_uncached": uncached,
            "encoded": [tokenizer(t, add_special_tokens=False).input_ids for t in job["texts"]],
            "decoded": [tokenizer.decode(tokenizer(t).input_ids, skip_special_tokens=True) for t in job["texts"]],
            "modules": sorted({m.split(".")[0] for m in sys.modules}),
            "router_dtype": str(next(p.dtype for n, p in model.named_parameters() if ".router." in n)) if any(".router." in n for n, _ in model.named_parameters()) else None,
        }
        if i == 0:  # AutoTokenizer without trust_remote_code: transformers asks about the model's code, then falls back
            plain = AutoTokenizer.from_pretrained(ex["dir"])
            result["plain_tokenizer_encoded"] = [plain(t, add_special_tokens=False).input_ids for t in job["texts"]]
        results.append(result)
    torch.save(results, out_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
