"""The lock files of requirements/locks/ (scripts/lock.sh) agree with the requirement files they
are compiled from: every package pinned to one version with hashes, every requirement present at
a version its specifier (or its override) admits, the training lock a subset of the test lock,
the GPU image's sets (its pure-Python set, what its engine stage builds and adds, the GPU check's
offline set) at the pins the cluster environment tests on CPU, and the image's Transformer Engine
built for the CUDA of its torch. Text only: no installer, no network (a requirement added without
re-locking fails here; tests/vllm/test_image_python_stack.py re-resolves the image's locks)."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements"
LOCKS = REQUIREMENTS / "locks"
MAX_LOCK_BYTES = 2_000_000  # a bound on what is parsed (the largest lock is ~0.5 MB)
# lock -> (its requirement file, its override file or None)
SOURCES = {
    "uv.txt": ("uv.txt", None),
    "cpu.txt": ("cpu.txt", None),
    "train.txt": ("core.txt", None),
    "cluster.txt": ("cluster.txt", "cluster-overrides.txt"),
    "aligner.txt": ("aligner.txt", None),
    "image.txt": ("image.txt", "image-overrides.txt"),
    "image-aligner.txt": ("image.txt", "image-overrides.txt"),
    "image-build.txt": ("image-build.txt", None),
    "image-stack.txt": ("image-stack.txt", None),
    "gpu_check.txt": ("gpu_check.txt", "gpu_check-overrides.txt"),
}
# The engine image's locks, all resolved at locks/cluster.txt's pins (scripts/lock.sh)
IMAGE_LOCKS = ("image.txt", "image-build.txt", "image-stack.txt", "gpu_check.txt")
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*\\?$")


def requirement_lines(path: Path) -> List[Tuple[str, str]]:
    """(file name, requirement) of every requirement in ``path``, following ``-r`` includes."""
    found = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split(" #")[0].split("\t#")[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("-r "):
            found += requirement_lines(path.parent / line[3:].strip())
        elif not line.startswith("-"):
            found.append((f"{path.name}:{number}", line))
    return found


def requirements(name: str) -> Dict[str, Requirement]:
    return {canonicalize_name(Requirement(text).name): Requirement(text)
            for _, text in requirement_lines(REQUIREMENTS / name)}


def pins(lock: str) -> Dict[str, Tuple[str, List[str]]]:
    """{package: (version, hashes)} of a lock file; fails on an unpinned or hash-less entry."""
    path = LOCKS / lock
    assert path.stat().st_size < MAX_LOCK_BYTES, f"{path} is larger than {MAX_LOCK_BYTES} bytes"
    entries: Dict[str, Tuple[str, List[str]]] = {}
    current = None
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or stripped.startswith("--find-links"):
            continue
        if stripped.startswith("--hash=sha256:"):
            assert current is not None, f"{path}:{number}: a hash before any package"
            entries[current][1].append(stripped.split(":", 1)[1].rstrip(" \\"))
            continue
        match = PIN.match(stripped)
        assert match, f"{path}:{number}: not an exact pin: {stripped!r}"
        current = canonicalize_name(match.group(1))
        entries[current] = (match.group(2), [])
    for package, (_, hashes) in entries.items():
        assert hashes, f"{path}: {package} has no hash"
    return entries


def _never_installed(requirement: Requirement) -> bool:
    return requirement.marker is not None and "never" in str(requirement.marker)


@pytest.mark.parametrize("lock", sorted(SOURCES))
def test_every_requirement_is_locked_at_a_version_it_admits(lock):
    source, overrides_file = SOURCES[lock]
    locked = pins(lock)
    overrides = requirements(overrides_file) if overrides_file else {}
    for package, requirement in requirements(source).items():
        requirement = overrides.get(package, requirement)
        if _never_installed(requirement):
            assert package not in locked, f"{lock}: {package} is removed by {overrides_file} but locked"
            continue
        assert package in locked, f"{lock}: {package} ({source}) is not locked: run scripts/lock.sh"
        version = locked[package][0]
        assert requirement.specifier.contains(version, prereleases=True), \
            f"{lock}: {package}=={version} does not satisfy {requirement} ({source}): run scripts/lock.sh"


def test_the_training_lock_is_the_test_lock_cut_down():
    test_pins = pins("cpu.txt")
    for package, (version, _) in pins("train.txt").items():
        assert test_pins.get(package, (None,))[0] == version, f"train.txt pins {package}=={version}"


@pytest.mark.parametrize("lock", IMAGE_LOCKS)
def test_the_images_sets_are_what_the_cluster_environment_tests(lock):
    """What the cluster lock has, an image lock pins alike (the image's project set has nothing else)."""
    cluster = pins("cluster.txt")
    for package, (version, _) in pins(lock).items():
        if lock == "image.txt" or package in cluster:
            assert cluster.get(package, (None,))[0] == version, \
                f"{lock} pins {package}=={version}, cluster.txt {cluster.get(package, ('nothing',))[0]}"


def test_a_package_of_several_image_locks_has_one_version():
    versions: Dict[str, set] = {}
    for lock in IMAGE_LOCKS:
        for package, (version, _) in pins(lock).items():
            versions.setdefault(package, set()).add(f"{version} ({lock})")
    assert not {p: v for p, v in versions.items() if len({x.split()[0] for x in v}) > 1}


def cuda_major(version: str) -> int:
    return int(version.split(".")[0])


def test_the_images_transformer_engine_is_built_for_its_torchs_cuda():
    """One Transformer Engine core library, for the CUDA major of the image's torch (torch 2.13.0
    requires cuda-toolkit 13.0.x), as requirements/image-stack.txt's extra asks, all of one release."""
    stack = pins("image-stack.txt")
    cores = {name: version for name, (version, _) in stack.items() if re.fullmatch(r"transformer-engine-cu\d+", name)}
    assert len(cores) == 1, f"image-stack.txt: Transformer Engine cores {sorted(cores)}: one CUDA only"
    (core, te_version), = cores.items()
    torch_cuda = cuda_major(stack["cuda-toolkit"][0])
    assert core == f"transformer-engine-cu{torch_cuda}", \
        f"{core} in an image whose torch has CUDA {stack['cuda-toolkit'][0]} (cuda-toolkit)"
    (requirement,) = [r for _, r in requirement_lines(REQUIREMENTS / "image-stack.txt")
                      if canonicalize_name(Requirement(r).name) == "transformer-engine"]
    assert Requirement(requirement).extras == {"pytorch", f"core_cu{torch_cuda}"}, requirement
    for part in ("transformer-engine", "transformer-engine-torch"):
        assert stack[part][0] == te_version, f"{part}=={stack[part][0]} beside {core}=={te_version}"


def test_the_gpu_checks_set_names_packages_and_takes_the_images_versions():
    """requirements/gpu_check.txt has no version of its own: its lock takes the image's (one place)."""
    for where, text in requirement_lines(REQUIREMENTS / "gpu_check.txt"):
        assert not Requirement(text).specifier, f"{where}: {text}: the version comes from the image's locks"
    image = {**pins("image.txt"), **pins("image-stack.txt")}
    for package, (version, _) in pins("gpu_check.txt").items():
        assert image[package][0] == version, f"gpu_check.txt pins {package}=={version}, the image {image[package][0]}"


def test_the_local_cpu_torch_wheel_matches_its_locked_hash():
    # Python 3.11's torch==2.13.0+cpu is the wheel on these machines' disk (not on PyPI).
    version, hashes = pins("cpu.txt")["torch"]
    assert version.endswith("+cpu")
    wheels = sorted(Path("/opt/wheels").glob(f"torch-{version}-cp311-*.whl"))
    if not wheels:
        pytest.skip("no /opt/wheels torch wheel on this machine")
    assert hashlib.sha256(wheels[0].read_bytes()).hexdigest() in hashes
