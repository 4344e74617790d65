"""Convert the public datasets to the project's JSONL schema (docs/interfaces.md).

    python recipes/prepare_data.py --out data/                  # every dataset, from the hub
    python recipes/prepare_data.py --dataset math500 aime24 --out data/
    python recipes/prepare_data.py --dataset math500 --input rows.jsonl --out data/   # offline rows
    python recipes/prepare_data.py --list

Needs the `datasets` package and hub access (requirements/data.txt) unless --input gives the raw
rows as JSONL. Writes <out>/<name>.jsonl, one record per row. Converters come from every
module's DATASETS: quatro_nemo.data.math_datasets and, when present, quatro_nemo.data.code_datasets.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from quatro_nemo.data.schema import DatasetSource, iter_jsonl  # noqa: E402

DATASET_MODULES = ("quatro_nemo.data.math_datasets", "quatro_nemo.data.code_datasets")


def collect_datasets(modules: Sequence[str] = DATASET_MODULES) -> Dict[str, DatasetSource]:
    """Union of the modules' DATASETS; a module that does not exist is skipped."""
    out: Dict[str, DatasetSource] = {}
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name == module_name:
                continue
            raise
        for name, source in getattr(module, "DATASETS").items():
            if name in out:
                raise ValueError(f"dataset name {name!r} defined twice (second time in {module_name})")
            out[name] = source
    return out


def load_hub_rows(source: DatasetSource) -> Iterable[Dict[str, Any]]:
    try:
        from datasets import load_dataset
    except ImportError as err:
        raise SystemExit("reading from the hub needs `pip install -r requirements/data.txt` "
                         "(or pass --input rows.jsonl)") from err
    return load_dataset(source.hub_id, source.config, split=source.split)


def convert_rows(source: DatasetSource, rows: Iterable[Dict[str, Any]]) -> List[Dict[str, Any]]:
    # a converter returns None for rows it cannot use (e.g. an APPS problem without tests)
    converted = (source.convert_row(dict(row), index) for index, row in enumerate(rows))
    records = [record for record in converted if record is not None]
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids):
        dupes = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"{source.hub_id}: duplicate record ids {dupes}")
    return records


def write_jsonl(path: str, records: Iterable[Dict[str, Any]]) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            count += 1
    return count


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, str]:
    datasets = collect_datasets()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", nargs="+", default=None, help=f"names (default: all): {sorted(datasets)}")
    p.add_argument("--input", default=None, help="raw rows as JSONL instead of the hub (one --dataset)")
    p.add_argument("--out", default="data")
    p.add_argument("--list", action="store_true", help="print the known datasets and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, s in sorted(datasets.items()):
            print(f"{name:16s} {s.hub_id} [{s.config or '-'}:{s.split}]  {s.description}")
        return {}
    names = args.dataset or sorted(datasets)
    unknown = [n for n in names if n not in datasets]
    if unknown:
        raise SystemExit(f"unknown dataset(s) {unknown}; choose from {sorted(datasets)}")
    if args.input and len(names) != 1:
        raise SystemExit("--input converts one dataset: give exactly one --dataset")
    os.makedirs(args.out, exist_ok=True)
    written = {}
    for name in names:
        source = datasets[name]
        rows = [row for _, row in iter_jsonl(args.input)] if args.input else load_hub_rows(source)
        path = os.path.join(args.out, f"{name}.jsonl")
        count = write_jsonl(path, convert_rows(source, rows))
        print(f"{name}: {count} records -> {path}")
        written[name] = path
    return written


if __name__ == "__main__":
    main()
