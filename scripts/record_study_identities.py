#!/usr/bin/env python
"""Record run identities in committed study results kept before runs had them (issue 40).

    python scripts/record_study_identities.py design full adaptive

For each study NAME (conf/study/NAME.yaml), every kept run in docs/study_results/NAME/metrics/
without an identity record gets the identity of the study's run of that name today
(quatro_nemo.study.results.record_identities): its records stay as they are, so the committed
reports rebuild the same (tests/study/test_committed_studies.py), and ``recipes/study.py
study=NAME`` counts those runs as done. Run it once; files that have an identity are left alone.
"""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from quatro_nemo.study.config import load_study_config  # noqa: E402
from quatro_nemo.study.results import record_identities  # noqa: E402


def main(names) -> int:
    if not names:
        print(__doc__, file=sys.stderr)
        return 2
    for name in names:
        results = os.path.join(REPO, "docs", "study_results", name)
        count = record_identities(load_study_config(name), results)
        print(f"{name}: identities recorded for {count} kept runs in {results}/metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
