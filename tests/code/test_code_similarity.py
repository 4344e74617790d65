"""Code-aware near-duplicate criterion: checked against a brute-force LCS and hand-built cases."""
import numpy as np

from quatro_nemo.eval.code_similarity import normalize_code
from quatro_nemo.eval.similarity import cluster_code_solutions, code_similarity, tokenize

SUM_LOOP = '''
def total(values):
    """Sum of values."""
    result = 0
    for v in values:   # accumulate
        result += v
    return result
'''
SUM_LOOP_RENAMED = '''
def add_all(xs: list) -> int:
    acc = 0

    for item in xs:
        acc += item
    return (acc)
'''
SUM_BUILTIN = "def total(values):\n    return sum(values)\n"
SUM_RECURSIVE = '''
def total(values):
    if not values:
        return 0
    return values[0] + total(values[1:])
'''


def _lcs(a, b):
    """Textbook O(|a||b|) dynamic programme: the independent reference for ROUGE-L."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = table[i - 1][j - 1] + 1 if a[i - 1] == b[j - 1] else max(table[i - 1][j], table[i][j - 1])
    return table[-1][-1]


def test_renaming_comments_and_layout_do_not_matter():
    assert normalize_code(SUM_LOOP) == normalize_code(SUM_LOOP_RENAMED)
    assert code_similarity([SUM_LOOP, SUM_LOOP_RENAMED])[0, 1] == 1.0
    # responses are compared on the program inside their markdown fence
    assert code_similarity([f"Here:\n```python\n{SUM_LOOP}```\nDone.", SUM_LOOP_RENAMED])[0, 1] == 1.0


def test_builtins_and_imports_are_kept():
    a = normalize_code("import math\ndef f(x):\n    return math.sqrt(len(x))\n")
    assert "math.sqrt(len(v1))" in a and "def v0(v1)" in a


def test_similarity_equals_token_rouge_l_of_normalised_code():
    texts = [SUM_LOOP, SUM_BUILTIN, SUM_RECURSIVE, "def broken(:\n  pass"]
    sim = code_similarity(texts)
    tokens = [tokenize(normalize_code(t)) for t in texts]
    for i in range(len(texts)):
        for j in range(len(texts)):
            expected = 2 * _lcs(tokens[i], tokens[j]) / (len(tokens[i]) + len(tokens[j]))
            assert np.isclose(sim[i, j], expected, atol=1e-12), (i, j)


def test_clusters_group_only_near_duplicates():
    fenced = lambda code: f"Solution:\n```python\n{code}```"
    responses = [fenced(SUM_LOOP), fenced(SUM_BUILTIN), SUM_LOOP_RENAMED, fenced(SUM_RECURSIVE), fenced(SUM_LOOP)]
    assert cluster_code_solutions(responses, threshold=0.9) == [3, 1, 1]
    assert cluster_code_solutions(responses, threshold=0.0) == [5]
