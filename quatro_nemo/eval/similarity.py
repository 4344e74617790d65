"""Pairwise similarity between responses, and near-duplicate clustering for UCC@k.

The paper (App. C.5) measures surface-form similarity among correct responses with TF-IDF
cosine, ROUGE-L, token Jaccard and normalised edit similarity, and uses the same metrics as the
near-duplicate criterion when clustering correct responses for UCC@k. Each metric here maps a
list of m texts to an [m, m] float64 matrix with ones on the diagonal, built with maintained
libraries (rapidfuzz, scikit-learn) rather than hand-written string algorithms:

- ``exact``:   1 if the texts are equal after normalisation (lower case, collapsed whitespace).
- ``jaccard``: |A n B| / |A u B| over token sets (sparse binary products).
- ``rouge_l``: ROUGE-L F1 over tokens, 2 LCS(a, b) / (|a| + |b|) (Lin 2004). Computed as
               rapidfuzz's normalised Indel similarity on strings in which every distinct token is
               one character: Indel distance = |a| + |b| - 2 LCS, so the two are identical.
- ``edit``:    1 - Levenshtein(a, b) / max(|a|, |b|) on characters (rapidfuzz).
- ``tfidf``:   cosine of TF-IDF vectors over tokens (scikit-learn, smooth idf, l2 norm); the
               idf is fitted on the texts being compared (one problem's correct responses).
- ``embedding``: optional, cosine of sentence-transformers embeddings (not installed by default).

Tokens: lower-cased words (``\\w+``) and single non-space symbols, so ``x^2+1`` gives
``x ^ 2 + 1``: maths notation counts, unlike rouge-score's default tokenizer which drops it.
"""
from __future__ import annotations

import re
from typing import Callable, Dict, List, Sequence

import numpy as np
import scipy.sparse
from scipy.sparse.csgraph import connected_components

from quatro_nemo.eval.code_similarity import normalized_program

_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def tokenize(text: str) -> List[str]:
    """Lower-cased words and single symbols: the token definition of every token metric."""
    return _TOKEN_RE.findall(text.lower())


def normalize_text(text: str) -> str:
    """Lower case, whitespace collapsed: the key of the ``exact`` criterion."""
    return " ".join(text.lower().split())


def _token_ids(texts: Sequence[str]) -> List[np.ndarray]:
    """Each text as an int array of token ids (ids shared across `texts`)."""
    vocab: Dict[str, int] = {}
    return [np.array([vocab.setdefault(tok, len(vocab)) for tok in tokenize(text)], dtype=np.int64)
            for text in texts]


def _ids_as_string(ids: np.ndarray) -> str:
    """One character per token id (code points from U+0100, skipping the surrogate block)."""
    codes = ids + 0x100
    codes[codes >= 0xD800] += 0x800
    return codes.astype("<u4").tobytes().decode("utf-32-le")


def _tokens_as_strings(texts: Sequence[str]) -> List[str]:
    """Map each distinct token to one character, so that char-level LCS = token-level LCS."""
    return [_ids_as_string(ids) for ids in _token_ids(texts)]


def exact_similarity(texts: Sequence[str], workers: int = 1) -> np.ndarray:
    keys = [normalize_text(t) for t in texts]
    _, inverse = np.unique(np.array(keys, dtype=object), return_inverse=True)
    return (inverse[:, None] == inverse[None, :]).astype(np.float64)


def _binary_token_matrix(texts: Sequence[str]) -> scipy.sparse.csr_matrix:
    from sklearn.feature_extraction.text import CountVectorizer

    vectorizer = CountVectorizer(tokenizer=tokenize, lowercase=False, token_pattern=None, binary=True)
    try:
        return vectorizer.fit_transform(texts).astype(np.float64).tocsr()
    except ValueError:                    # every text empty: no vocabulary
        return scipy.sparse.csr_matrix((len(texts), 0))


def jaccard_similarity(texts: Sequence[str], workers: int = 1) -> np.ndarray:
    x = _binary_token_matrix(texts)                         # [m, V] 0/1
    inter = np.asarray((x @ x.T).todense())                 # |A n B|
    sizes = np.asarray(x.sum(axis=1)).ravel()
    union = sizes[:, None] + sizes[None, :] - inter         # |A u B|
    with np.errstate(invalid="ignore", divide="ignore"):
        sim = np.where(union > 0, inter / union, 1.0)       # two empty texts are identical
    return sim


def rouge_l_similarity(texts: Sequence[str], workers: int = 1) -> np.ndarray:
    from rapidfuzz.distance import Indel
    from rapidfuzz.process import cdist

    strings = _tokens_as_strings(texts)
    # Same list for queries and choices: rapidfuzz computes only one triangle.
    sim = cdist(strings, strings, scorer=Indel.normalized_similarity, workers=workers, dtype=np.float64)
    return np.asarray(sim, dtype=np.float64)


def edit_similarity(texts: Sequence[str], workers: int = 1) -> np.ndarray:
    from rapidfuzz.distance import Levenshtein
    from rapidfuzz.process import cdist

    texts = list(texts)
    sim = cdist(texts, texts, scorer=Levenshtein.normalized_similarity, workers=workers, dtype=np.float64)
    return np.asarray(sim, dtype=np.float64)


def tfidf_cosine_similarity(texts: Sequence[str], workers: int = 1) -> np.ndarray:
    from sklearn.feature_extraction.text import TfidfVectorizer

    vectorizer = TfidfVectorizer(tokenizer=tokenize, lowercase=False, token_pattern=None)
    try:
        x = vectorizer.fit_transform(texts)                 # rows l2-normalised
    except ValueError:
        return np.ones((len(texts), len(texts)))
    sim = np.asarray((x @ x.T).todense(), dtype=np.float64)
    empty = np.asarray(x.getnnz(axis=1) == 0)
    sim[np.ix_(empty, empty)] = 1.0                         # empty texts are identical
    np.fill_diagonal(sim, 1.0)
    return np.clip(sim, 0.0, 1.0)


def embedding_similarity(texts: Sequence[str], workers: int = 1,
                         model_name: str = "sentence-transformers/all-MiniLM-L6-v2") -> np.ndarray:
    try:
        from sentence_transformers import SentenceTransformer
    except ImportError as err:
        raise ImportError("the 'embedding' similarity needs `pip install sentence-transformers` "
                          "and a local copy of the embedding model") from err
    emb = SentenceTransformer(model_name).encode(list(texts), normalize_embeddings=True)
    return np.clip(np.asarray(emb @ emb.T, dtype=np.float64), -1.0, 1.0)


def code_similarity(texts: Sequence[str], workers: int = 1) -> np.ndarray:
    """[m, m] float64 similarity of the programs in `texts` (responses or bare code): token
    ROUGE-L F1 of their normalised programs (``quatro_nemo.eval.code_similarity``)."""
    return rouge_l_similarity([normalized_program(t) for t in texts], workers=workers)


SimilarityFn = Callable[..., np.ndarray]

SIMILARITY_METRICS: Dict[str, SimilarityFn] = {
    "code": code_similarity,
    "exact": exact_similarity,
    "jaccard": jaccard_similarity,
    "rouge_l": rouge_l_similarity,
    "edit": edit_similarity,
    "tfidf": tfidf_cosine_similarity,
    "embedding": embedding_similarity,
}

# [choice] near-duplicate thresholds; the paper does not state its values. Override per run.
DEFAULT_THRESHOLDS: Dict[str, float] = {
    "code": 0.9, "exact": 1.0, "jaccard": 0.8, "rouge_l": 0.8, "edit": 0.8, "tfidf": 0.9, "embedding": 0.95,
}


def get_similarity(name: str) -> SimilarityFn:
    if name not in SIMILARITY_METRICS:
        raise ValueError(f"unknown similarity metric {name!r}; choose one of {sorted(SIMILARITY_METRICS)}")
    return SIMILARITY_METRICS[name]


def pairwise_similarity(texts: Sequence[str], metric: str, workers: int = 1) -> np.ndarray:
    """[m, m] similarity matrix of `texts` under `metric` (see the module docstring)."""
    return get_similarity(metric)(list(texts), workers=workers)


def mean_pairwise_similarity(sim: np.ndarray) -> float:
    """Mean of sim[i, j] over unordered pairs i < j; NaN when there are fewer than 2 texts."""
    m = sim.shape[0]
    if m < 2:
        return float("nan")
    rows, cols = np.triu_indices(m, k=1)
    return float(sim[rows, cols].mean())


def cluster_near_duplicates(texts: Sequence[str], metric: str, threshold: float,
                            workers: int = 1) -> List[int]:
    """Cluster sizes of `texts` under single linkage: i ~ j when similarity(i, j) >= threshold.

    Clusters are the connected components of that graph (near-duplicates chained together are
    one solution). Texts equal after normalisation are merged first, so the pairwise metric only
    runs on distinct texts. ``rouge_l`` skips pairs that cannot matter (see
    :func:`_rouge_l_components`; the components are still exactly those of the full graph); the
    other metrics build the full [m, m] matrix. Returns the sizes (summing to len(texts)),
    largest first.
    """
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"similarity threshold must be in [0, 1], got {threshold}")
    if not texts:
        return []
    keys = [normalize_text(t) for t in texts]
    distinct: Dict[str, int] = {}
    multiplicity: List[int] = []
    representatives: List[str] = []
    for text, key in zip(texts, keys):
        idx = distinct.get(key)
        if idx is None:
            distinct[key] = len(representatives)
            representatives.append(text)
            multiplicity.append(1)
        else:
            multiplicity[idx] += 1
    if metric == "exact" or len(representatives) == 1:
        labels = np.arange(len(representatives))
    elif metric == "rouge_l":
        labels = _rouge_l_components(representatives, threshold)
    else:
        adjacency = pairwise_similarity(representatives, metric, workers=workers) >= threshold
        _, labels = connected_components(scipy.sparse.csr_matrix(adjacency), directed=False)
    sizes = np.bincount(labels, weights=np.asarray(multiplicity, dtype=np.float64)).astype(np.int64)
    return sorted((int(s) for s in sizes if s > 0), reverse=True)


def _multiset_overlap(token_ids: Sequence[np.ndarray]) -> np.ndarray:
    """[m, m] sum over tokens of min(count in a, count in b), by one sparse product.

    Each token occurrence becomes a feature (token, k-th occurrence in its text), so the dot
    product of two 0/1 rows counts min(count_a, count_b) for every token.
    """
    lengths = np.array([len(ids) for ids in token_ids], dtype=np.int64)
    if lengths.sum() == 0:
        return np.zeros((len(token_ids), len(token_ids)))
    rows = np.repeat(np.arange(len(token_ids)), lengths)
    ids = np.concatenate(token_ids)
    order = np.lexsort((ids, rows))                         # grouped by (text, token)
    rows_s, ids_s = rows[order], ids[order]
    new_group = np.ones(len(ids_s), dtype=bool)
    new_group[1:] = (rows_s[1:] != rows_s[:-1]) | (ids_s[1:] != ids_s[:-1])
    group_start = np.maximum.accumulate(np.where(new_group, np.arange(len(ids_s)), 0))
    rank = np.arange(len(ids_s)) - group_start              # k-th occurrence, from 0
    _, cols = np.unique(ids_s * (rank.max() + 1) + rank, return_inverse=True)
    x = scipy.sparse.csr_matrix((np.ones(len(cols)), (rows_s, cols.ravel())),
                                shape=(len(token_ids), int(cols.max()) + 1))
    return np.asarray((x @ x.T).todense())


def _rouge_l_components(texts: Sequence[str], threshold: float) -> np.ndarray:
    """Connected components of {(i, j): ROUGE-L(i, j) >= threshold}, exactly, with few LCS calls.

    1. Upper bound: LCS(a, b) <= multiset overlap of their tokens, so
       ROUGE-L <= 2 overlap / (|a| + |b|); pairs below the threshold cannot be edges.
    2. Remaining pairs in order, union-find: a pair already in one component cannot change the
       components and is skipped; otherwise its exact ROUGE-L decides. Near-duplicates then cost
       about one LCS each instead of one per pair, and the components are those of the full graph.
    """
    from rapidfuzz.distance import Indel

    token_ids = _token_ids(texts)
    strings = [_ids_as_string(ids) for ids in token_ids]
    lengths = np.array([len(ids) for ids in token_ids], dtype=np.float64)
    total = lengths[:, None] + lengths[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        bound = np.where(total > 0, 2.0 * _multiset_overlap(token_ids) / total, 1.0)
    rows, cols = np.nonzero(np.triu(bound >= threshold - 1e-12, k=1))
    parent = list(range(len(strings)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in zip(rows.tolist(), cols.tolist()):
        root_i, root_j = find(i), find(j)
        if root_i != root_j and Indel.normalized_similarity(strings[i], strings[j]) >= threshold:
            parent[root_i] = root_j
    return np.array([find(i) for i in range(len(strings))])


def cluster_code_solutions(responses: Sequence[str], threshold: float = DEFAULT_THRESHOLDS["code"],
                           workers: int = 1) -> List[int]:
    """Cluster sizes (largest first) of the programs in `responses` (code extracted from
    markdown fences as for grading): the near-duplicate clusters of UCC@k on code."""
    programs = [normalized_program(r) for r in responses]
    return cluster_near_duplicates(programs, metric="rouge_l", threshold=threshold, workers=workers)
