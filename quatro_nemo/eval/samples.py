"""Samples files: what the evaluation reads (one JSON object per line, one line per problem).

    {"id": "math500/12", "benchmark": "math500", "answer": "\\\\frac{1}{2}",
     "responses": ["... \\\\boxed{1/2}", ...],            # n responses
     "prompt": "...",                                     # optional
     "logprobs": [[-0.1, -2.3, ...], ...],                # optional: per response, per generated
                                                          #   token, log p of the sampled token
     "entropies": [[0.7, 1.2, ...], ...],                 # optional: per response, per token,
                                                          #   full-vocabulary entropy
     "rewards": [1.0, 0.0, ...],                          # optional: precomputed rewards in [0, 1]
     "cluster_sizes": [3, 1]}                             # optional: sizes of the clusters of
                                                          #   correct responses (--ucc-metric precomputed)

A bad record raises ValueError naming the file, the line and the key.
"""
from __future__ import annotations

import json
from typing import Any, Dict, Iterable, List

from quatro_nemo.data.schema import iter_jsonl

REQUIRED_SAMPLE_KEYS = ("id", "benchmark", "answer", "responses")
PER_RESPONSE_KEYS = ("logprobs", "entropies", "rewards")


def validate_sample(record: Dict[str, Any], where: str) -> None:
    """Raise ValueError naming `where` (e.g. 'runs/a.jsonl line 3') for a malformed record."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUIRED_SAMPLE_KEYS if k not in record]
    if missing:
        raise ValueError(f"{where}: sample record is missing key(s) {missing}")
    responses = record["responses"]
    if not isinstance(responses, list) or not responses or not all(isinstance(r, str) for r in responses):
        raise ValueError(f"{where}: 'responses' must be a non-empty list of strings")
    for key in PER_RESPONSE_KEYS:
        if key in record and record[key] is not None:
            value = record[key]
            if not isinstance(value, list) or len(value) != len(responses):
                raise ValueError(f"{where}: '{key}' must be a list with one entry per response "
                                 f"({len(responses)}), got {type(value).__name__} of length "
                                 f"{len(value) if isinstance(value, list) else '-'}")
    if record.get("rewards") is not None:
        for r in record["rewards"]:
            if not isinstance(r, (int, float)) or not 0.0 <= float(r) <= 1.0:
                raise ValueError(f"{where}: 'rewards' must hold numbers in [0, 1], got {r!r}")


def load_samples(path: str) -> List[Dict[str, Any]]:
    """Read and validate a samples JSONL file; (benchmark, id) must be unique."""
    records: List[Dict[str, Any]] = []
    seen = set()
    for where, record in iter_jsonl(path):
        validate_sample(record, where)
        key = (record["benchmark"], str(record["id"]))
        if key in seen:
            raise ValueError(f"{where}: duplicate problem id {key[1]!r} in benchmark {key[0]!r}")
        seen.add(key)
        records.append(record)
    if not records:
        raise ValueError(f"{path}: no sample records")
    return records


def write_samples(path: str, records: Iterable[Dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
