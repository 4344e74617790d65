"""The engine's front door: a typed request in, a run directory out.

    base = load_config(["config=config"])                      # composed and validated once
    request = RunRequest(configured(base, {"trainer.lr": 6e-4, "run.seed": 2, "run.dir": "runs/a"}),
                         EvalRequest(num_problems=128, n_samples=128, top_p=(0.7, 1.0)))
    directory = preflight(request)   # the directory holds no other run; its identity is recorded
    run(request)                     # trains (resuming from its newest checkpoint), then evaluates
    directory.metrics(), directory.evaluation(), directory.load_policy()

recipes/train.py (a request without evaluation), the study (one request per run, built from its
base config with :func:`configured`, run by its fork server) and recipes/evaluate.py's
``checkpoint=`` (``RunDir.load_policy`` through engine/generate.py) come in here.

**Identity.** A run is what it computes: its resolved config, less what only says where and how
its output is written (:data:`IDENTITY_EXCLUDED`), and what it evaluates. :meth:`RunRequest.identity`
is that as plain data, :meth:`RunRequest.digest` a hash of it: two spellings of one run
(``trainer.lr=3e-4`` or ``0.0003``, keys in any order) are one digest, any other value another.
A run recorded before a config key existed is the same run as a request whose value of that key
is the schema's default (:func:`identity_differences`): adding a key with a default that keeps
today's behaviour does not make every recorded run a new one.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import DictConfig, OmegaConf

from quatro_nemo.engine.config import ExperimentConfig, validate
from quatro_nemo.engine.heldout import EvalRequest, evaluate_final_policy, write_records
from quatro_nemo.engine.loop import train
from quatro_nemo.engine.run_dir import EVALUATION_FILE, RunDir
from quatro_nemo.validation import ConfigError

# Keys that say where and how a run writes, not what it computes (a resumed run is the same run
# whatever its checkpoint cadence; the warm-start cache is keyed by what it holds).
IDENTITY_EXCLUDED = ("run.dir", "run.resume", "run.progress_bar", "logging", "trainer.checkpoint_every",
                     "trainer.keep_checkpoints", "warmstart.cache_dir")
_ABSENT = object()


class RunIdentityError(ConfigError):
    """A run directory holds another run than the request's."""


def configured(base: ExperimentConfig, values: Mapping[str, Any]) -> ExperimentConfig:
    """``base`` with typed ``values`` set at their dotted keys (``{"trainer.lr": 6e-4}``), validated
    again as a composed config is (the same checks, the same resolved config as the override on
    the command line); every key must be one of ``base``'s, else ConfigError naming it."""
    tree = copy.deepcopy(base.raw)
    for key, value in values.items():
        if OmegaConf.select(tree, key, default=_ABSENT) is _ABSENT:
            raise ConfigError(f"config key {key}: not a key of the run config")
        OmegaConf.update(tree, key, value.value if isinstance(value, Enum) else value, merge=False)
    return validate(tree)


def config_identity(raw: DictConfig) -> Dict[str, Any]:
    """A resolved config (``ExperimentConfig.raw``, or a run's config.yaml) as plain data, without
    :data:`IDENTITY_EXCLUDED`."""
    plain = OmegaConf.to_container(raw, resolve=True)
    for key in IDENTITY_EXCLUDED:
        *sections, name = key.split(".")
        node = plain
        for section in sections:
            node = node.get(section, {})
        node.pop(name, None)
    return plain


def digest_of(identity: Mapping[str, Any]) -> str:
    """A short hash of an identity's canonical JSON (sorted keys)."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def identity_record(identity: Mapping[str, Any]) -> Dict[str, Any]:
    """``{"digest", "request"}``: what run directories and the study's kept metrics record."""
    return {"digest": digest_of(identity), "request": dict(identity)}


@dataclass(frozen=True)
class RunRequest:
    """One run: the validated config (``run.dir`` says where) and, optionally, the held-out
    evaluation of its final policy."""

    config: ExperimentConfig
    evaluation: Optional[EvalRequest] = None

    def identity(self) -> Dict[str, Any]:
        """What the run computes, as plain JSON data (module docstring)."""
        evaluation = None if self.evaluation is None else dataclasses.asdict(self.evaluation)
        return json.loads(json.dumps({"config": config_identity(self.config.raw), "evaluation": evaluation}))

    def digest(self) -> str:
        return digest_of(self.identity())

    def identity_record(self) -> Dict[str, Any]:
        return identity_record(self.identity())


def _flat(values: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(values, dict) or not values:
        return {prefix[:-1]: values} if prefix else {}
    out: Dict[str, Any] = {}
    for key, value in values.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def schema_default(cfg: ExperimentConfig, key: str) -> Any:
    """The dataclass default of the config key ``key`` (``algorithm.lr_control.kind``) in
    ``cfg``'s typed sections, as plain data; a sentinel when the key has none."""
    *sections, name = key.split(".")
    owner: Any = cfg
    for section in sections:
        owner = getattr(owner, section, None)
    fields = {f.name: f for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
    if name not in fields:
        return _ABSENT
    field = fields[name]
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return _ABSENT
    return json.loads(json.dumps(value.value if isinstance(value, Enum) else value))


def identity_differences(recorded: Mapping[str, Any], request: RunRequest) -> List[str]:
    """How a recorded identity (``RunRequest.identity()`` of an earlier request) differs from
    ``request``'s; [] when they are the same run. A config key the record lacks counts as equal
    when the request has the schema's default there (it was added after the record)."""
    old, new = _flat(dict(recorded)), _flat(request.identity())
    differences = []
    for key in sorted(set(old) | set(new)):
        if key not in new:
            differences.append(f"{key}={old[key]!r} recorded, no longer a key")
        elif key not in old:
            default = schema_default(request.config, key.split(".", 1)[1]) if key.startswith("config.") else _ABSENT
            if default is _ABSENT or new[key] != default:
                differences.append(f"{key}={new[key]!r} not recorded (and not its default)")
        elif old[key] != new[key]:
            differences.append(f"{key}: recorded {old[key]!r}, requested {new[key]!r}")
    return differences


def same_run(record: Mapping[str, Any], request: RunRequest) -> bool:
    """Whether an identity record (:meth:`RunRequest.identity_record`) is ``request``'s run."""
    return record.get("digest") == request.digest() or not identity_differences(record["request"], request)


def preflight(request: RunRequest) -> RunDir:
    """Claim ``run.dir`` for the request before it starts: a directory that recorded another
    run's identity, or that holds training output but no identity, is refused (RunIdentityError
    naming the differences): never silently reused, never silently redone. The identity is
    recorded when the directory is new. (recipes/train.py does not claim its directory: re-running
    it with more steps extends a run, by design.)"""
    directory = RunDir(request.config.run.dir)
    record = directory.recorded_identity()
    if record is None:
        if directory.has_training_output():
            raise RunIdentityError(f"run directory {directory.path} holds training output but no {request.digest()} "
                                   "identity (started by another version or by hand): use another directory or "
                                   "delete it")
        directory.record_identity(request.identity_record())
    elif not same_run(record, request):
        differences = identity_differences(record["request"], request)
        raise RunIdentityError(f"run directory {directory.path} holds another run than this request "
                               f"(differences: {differences[:6]}); use another directory or delete it")
    return directory


def run(request: RunRequest) -> RunDir:
    """Train the request's run (resuming from its newest checkpoint; a run whose finished training
    has ``trainer.steps`` steps already is not retrained, one asked for more steps extends), then, with ``request.evaluation``, evaluate its final policy into the directory's
    evaluation records, which carry the seconds of each phase (``job_seconds``). A SIGTERM or
    SIGUSR1 makes the training checkpoint and raise ``Preempted`` (recipes exit 75 on it)."""
    directory = RunDir(request.config.run.dir)
    started = time.perf_counter()
    if not directory.is_trained(request.config.trainer.steps):
        train(request.config)
    trained = time.perf_counter()
    if request.evaluation is not None:
        records = evaluate_final_policy(directory, request.evaluation)
        seconds = {"train": round(trained - started, 2), "evaluate": round(time.perf_counter() - trained, 2)}
        write_records(directory.file(EVALUATION_FILE), [dict(r, job_seconds=seconds) for r in records])
    return directory
