"""Offline datasets for the lm-evaluation-harness tasks in this folder (`--include_path evals`).

Each loader reads a local file (the one shipped in evals/data by default, or the one given with
`--metadata '{"data_file": "/path/to/file"}'`) and returns a `datasets.DatasetDict` with a
`test` split, so lm-eval never reaches the Hugging Face Hub.
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _records(data_file, default: str) -> list[dict]:
    path = Path(data_file).expanduser() if data_file else HERE / "data" / default
    if not path.is_file():
        raise FileNotFoundError(f"evaluation data file {path} does not exist")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    # Plain text: one document per paragraph (separated by a blank line).
    return [{"text": p.strip()} for p in path.read_text(encoding="utf-8").split("\n\n") if p.strip()]


def load_text(data_file=None, **_):
    """Documents {"text": ...} for the rolling-loglikelihood (perplexity) task."""
    import datasets

    records = _records(data_file, "heldout.jsonl")
    if any("text" not in r for r in records):
        raise ValueError("every document of a perplexity data file needs a 'text' field")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list([{"text": r["text"]} for r in records])})


def load_choices(data_file=None, **_):
    """Questions {"question", "choices": [...], "answer": index} for the multiple-choice task."""
    import datasets

    records = _records(data_file, "facts_mc.jsonl")
    for r in records:
        if not (isinstance(r.get("choices"), list) and isinstance(r.get("answer"), int) and 0 <= r["answer"] < len(r["choices"])):
            raise ValueError(f"multiple-choice record needs 'question', a 'choices' list and an 'answer' index into it: {r}")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(records)})
