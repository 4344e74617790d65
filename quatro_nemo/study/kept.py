"""The study's kept metrics: one small gzip JSON-lines file per finished run, what the report is
built from and what makes a run done on any machine.

``<study>/metrics/<run>.jsonl.gz`` holds the run's identity record first (``kind = "identity"``:
the engine's ``RunRequest.identity_record()``, its resolved config and evaluation and their
digest), then its training records and the loop's held-out checkpoints (``kind`` ``train`` and
``eval``) and the held-out records of its final policy (``study_eval``); ``base.jsonl.gz`` the
base model's, with the identity of its evaluation. A run whose kept metrics carry its request's
identity is done (:func:`is_kept`), wherever they came from: this study's run, or a results
directory committed to the repository (``docs/study_results/<name>``, :func:`adopt`), which
``publish`` fills as runs finish, so a study continues from the repository alone.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
from typing import Any, Dict, List, Optional, Sequence

from quatro_nemo.engine.api import RunRequest, same_run
from quatro_nemo.engine.run_dir import RunDir

METRICS_DIR = "metrics"              # <study>/metrics/<run>.jsonl.gz
BASE = "base"                        # metrics/base.jsonl.gz: the base model's evaluation
IDENTITY_KIND = "identity"


def archive_path(study_dir: str, name: str) -> str:
    return os.path.join(study_dir, METRICS_DIR, f"{name}.jsonl.gz")


def write_archive(path: str, records: Sequence[Dict[str, Any]]) -> None:
    """gzip JSON lines with a fixed header time, so the same records give the same bytes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write("".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode())
    os.replace(tmp, path)


def read_archive(path: str) -> List[Dict[str, Any]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def kept_identity(path: str) -> Optional[Dict[str, Any]]:
    """The identity record of a kept file; None when it has none (or there is no file)."""
    if not os.path.isfile(path):
        return None
    return next((r for r in read_archive(path) if r.get("kind") == IDENTITY_KIND), None)


def is_kept(study_dir: str, name: str, request: RunRequest) -> bool:
    """Whether ``<study_dir>/metrics/<name>.jsonl.gz`` holds ``request``'s finished run."""
    record = kept_identity(archive_path(study_dir, name))
    return record is not None and same_run(record, request)


def keep(study_dir: str, name: str, identity: Dict[str, Any], records: Sequence[Dict[str, Any]]) -> None:
    """Write a run's kept metrics: ``identity`` (``RunRequest.identity_record()``) first."""
    write_archive(archive_path(study_dir, name), [dict(identity, kind=IDENTITY_KIND), *records])


def keep_run(study_dir: str, name: str, identity: Dict[str, Any], directory: RunDir,
             evaluation: Optional[List[Dict[str, Any]]] = None) -> None:
    """Keep a finished run: its training records, the loop's held-out checkpoints and the held-out
    records of its final policy (``evaluation``, default the directory's own)."""
    train = [r for r in directory.metrics() if r["kind"] in ("train", "eval")]
    keep(study_dir, name, identity, train + (directory.evaluation() if evaluation is None else evaluation))


def adopt(results_dir: Optional[str], study_dir: str, name: str, request: RunRequest) -> bool:
    """Copy ``request``'s kept metrics from ``results_dir`` (a committed study's results) into
    ``study_dir`` when they are there and ``study_dir`` does not have them; whether it did."""
    if results_dir is None or os.path.abspath(results_dir) == os.path.abspath(study_dir):
        return False
    if is_kept(study_dir, name, request) or not is_kept(results_dir, name, request):
        return False
    _copy(archive_path(results_dir, name), archive_path(study_dir, name))
    return True


def publish(study_dir: str, results_dir: str, name: str) -> str:
    """Copy a kept run into ``results_dir`` (to be committed); its path there."""
    target = archive_path(results_dir, name)
    _copy(archive_path(study_dir, name), target)
    return target


def _copy(source: str, target: str) -> None:
    """A copy that is complete or absent (a process stopped mid-copy leaves no half file)."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp{os.getpid()}"
    shutil.copyfile(source, tmp)
    os.replace(tmp, target)
