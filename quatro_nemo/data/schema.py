"""The JSONL record schema shared by every dataset, and the description of a public source."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

# Keys every record has; code problems add "tests" (and optionally "entry_point").
REQUIRED_KEYS = ("id", "benchmark", "prompt", "answer")


@dataclasses.dataclass(frozen=True)
class DatasetSource:
    """A public dataset on the hub and how one of its rows becomes one of our records."""

    hub_id: str
    split: str
    convert_row: Callable[[Dict[str, Any], int], Dict[str, Any]]  # (row, index) -> record
    config: Optional[str] = None
    description: str = ""


def validate_record(record: Dict[str, Any], where: str) -> None:
    """Raise ValueError naming `where` (e.g. 'file.jsonl line 12') if a record lacks a key."""
    missing = [k for k in REQUIRED_KEYS if k not in record]
    if missing:
        raise ValueError(f"{where}: record is missing required key(s) {missing}")


def iter_jsonl(path: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """(where, record) for each non-blank line of a JSONL file; `where` is 'PATH line N'.
    A missing file or a malformed line raises ValueError naming the file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"file not found: {path}")
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path} line {line_number}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err.msg})") from None


def read_problems(path: str) -> List[Dict[str, Any]]:
    """The validated records of a problem JSONL file, in file order (at least one)."""
    problems = []
    for where, record in iter_jsonl(path):
        validate_record(record, where)
        problems.append(record)
    if not problems:
        raise ValueError(f"{path}: no problems in the file")
    return problems
