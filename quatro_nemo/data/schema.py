"""The JSONL record schema shared by every dataset, and the description of a public source."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional

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
