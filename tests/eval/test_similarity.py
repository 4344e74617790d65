"""Similarity metrics against independent references: rouge-score (test-only oracle), plain
Python sets, a textbook Levenshtein DP, a hand-written TF-IDF; clustering against brute force."""
import math
import random
from collections import Counter

import numpy as np
import pytest

from quatro_nemo.eval.similarity import (cluster_near_duplicates, mean_pairwise_similarity, pairwise_similarity,
                                         tokenize)

WORDS = "the sum of x and y is equal to twice z so we get answer 2 3 + = ^ { } frac sqrt".split()


def random_texts(seed, count, lo=0, hi=40):
    rng = random.Random(seed)
    base = [rng.choice(WORDS) for _ in range(hi)]
    texts = []
    for _ in range(count):
        words = list(base[: rng.randint(lo, hi)])
        for _ in range(rng.randint(0, 10)):          # edits: substitutions and insertions
            if words and rng.random() < 0.5:
                words[rng.randrange(len(words))] = rng.choice(WORDS)
            else:
                words.insert(rng.randint(0, len(words)), rng.choice(WORDS))
        texts.append(" ".join(words))
    return texts


class _OurTokens:
    """rouge-score tokenizer interface with our token definition: the LCS is rouge-score's."""

    def tokenize(self, text):
        return tokenize(text)


def test_rouge_l_matches_rouge_score():
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_OurTokens())
    texts = random_texts(0, 14, lo=1) + ["Let $x^2+1 = 5$, so x = 2.", "x = 2 since x^2 + 1 = 5"]
    sim = pairwise_similarity(texts, "rouge_l")
    for i in range(len(texts)):
        for j in range(len(texts)):
            want = scorer.score(texts[i], texts[j])["rougeL"].fmeasure
            assert sim[i, j] == pytest.approx(want, abs=1e-12), (texts[i], texts[j])


def test_rouge_l_matches_rouge_score_default_tokenizer_on_plain_words():
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])       # its own tokenizer: identical on lower-case words
    texts = ["the cat sat on the mat", "the cat lay on a mat", "a dog sat on the cat", "mat"]
    sim = pairwise_similarity(texts, "rouge_l")
    for i in range(4):
        for j in range(4):
            assert sim[i, j] == pytest.approx(scorer.score(texts[i], texts[j])["rougeL"].fmeasure, abs=1e-12)


def test_jaccard_matches_python_sets():
    texts = random_texts(1, 12) + ["", ""]
    sim = pairwise_similarity(texts, "jaccard")
    for i, a in enumerate(texts):
        for j, b in enumerate(texts):
            sa, sb = set(tokenize(a)), set(tokenize(b))
            want = len(sa & sb) / len(sa | sb) if sa | sb else 1.0
            assert sim[i, j] == pytest.approx(want, abs=1e-12)


def levenshtein(a, b):
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, start=1):
        cur = [i]
        for j, cb in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def test_edit_similarity_matches_textbook_levenshtein():
    texts = ["kitten", "sitting", "", "flaw", "lawn", "x^2 + 1", "x^2+1"] + random_texts(2, 5, hi=8)
    sim = pairwise_similarity(texts, "edit")
    for i, a in enumerate(texts):
        for j, b in enumerate(texts):
            want = 1.0 - levenshtein(a, b) / max(len(a), len(b)) if (a or b) else 1.0
            assert sim[i, j] == pytest.approx(want, abs=1e-12)
    assert sim[0, 1] == pytest.approx(1 - 3 / 7)      # kitten -> sitting: 3 edits


def test_tfidf_cosine_matches_hand_written_tfidf():
    texts = random_texts(3, 10, lo=1)
    docs = [Counter(tokenize(t)) for t in texts]
    n = len(docs)
    vocab = sorted(set().union(*docs))
    df = {w: sum(1 for d in docs if w in d) for w in vocab}
    idf = {w: math.log((1 + n) / (1 + df[w])) + 1 for w in vocab}    # smooth idf
    vecs = np.array([[d[w] * idf[w] for w in vocab] for d in docs])
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    want = vecs @ vecs.T
    np.testing.assert_allclose(pairwise_similarity(texts, "tfidf"), np.clip(want, 0, 1), atol=1e-12)


def test_exact_similarity_normalises_case_and_whitespace():
    sim = pairwise_similarity(["The answer  is 5", "the answer is 5\n", "the answer is 6"], "exact")
    np.testing.assert_array_equal(sim, [[1, 1, 0], [1, 1, 0], [0, 0, 1]])


def test_mean_pairwise_similarity_is_the_mean_over_unordered_pairs():
    sim = np.array([[1.0, 0.2, 0.4], [0.2, 1.0, 0.9], [0.4, 0.9, 1.0]])
    assert mean_pairwise_similarity(sim) == pytest.approx((0.2 + 0.4 + 0.9) / 3)
    assert math.isnan(mean_pairwise_similarity(np.ones((1, 1))))


def brute_force_clusters(texts, sim_fn, threshold):
    """Union-find over every pair (i, j) with sim_fn(i, j) >= threshold."""
    parent = list(range(len(texts)))

    def find(i):
        while parent[i] != i:
            i = parent[i]
        return i

    for i in range(len(texts)):
        for j in range(i + 1, len(texts)):
            if sim_fn(texts[i], texts[j]) >= threshold:
                parent[find(i)] = find(j)
    return sorted(Counter(find(i) for i in range(len(texts))).values(), reverse=True)


@pytest.mark.parametrize("threshold", [0.5, 0.7, 0.9])
def test_clusters_match_brute_force_union_find_under_rouge_l(threshold):
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"], tokenizer=_OurTokens())
    texts = random_texts(4, 25, lo=5)
    texts += [texts[0], texts[1].upper(), texts[2] + "  "]          # exact duplicates after normalisation

    def ref(a, b):
        return 1.0 if " ".join(a.lower().split()) == " ".join(b.lower().split()) else scorer.score(a, b)["rougeL"].fmeasure

    want = brute_force_clusters(texts, ref, threshold)
    got = cluster_near_duplicates(texts, "rouge_l", threshold)
    assert got == want
    assert sum(got) == len(texts)


def test_clusters_chain_by_single_linkage_and_exact_counts_multiplicity():
    # a~b and b~c (one token edit each) but a !~ c at 0.8: one cluster of three by chaining
    a = "one two three four five six seven eight nine ten"
    b = "one two three four five six seven eight nine eleven"
    c = "one two three four five six seven twelve nine eleven"
    assert pairwise_similarity([a, c], "rouge_l")[0, 1] < 0.85
    assert cluster_near_duplicates([a, b, c], "rouge_l", 0.85) == [3]
    assert cluster_near_duplicates(["x", "X ", "y"], "exact", 1.0) == [2, 1]
    assert cluster_near_duplicates([], "jaccard", 0.5) == []
    with pytest.raises(ValueError):
        cluster_near_duplicates(["a"], "rouge_l", 1.5)
    with pytest.raises(ValueError, match="unknown similarity"):
        pairwise_similarity(["a"], "bleu")


def test_clusters_match_brute_force_union_find_under_jaccard():
    texts = random_texts(5, 25, lo=5)

    def ref(a, b):
        sa, sb = set(tokenize(a)), set(tokenize(b))
        return len(sa & sb) / len(sa | sb) if sa | sb else 1.0

    assert cluster_near_duplicates(texts, "jaccard", 0.75) == brute_force_clusters(texts, ref, 0.75)


def test_embedding_metric_is_optional_with_a_clear_error():
    try:
        import sentence_transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="sentence-transformers"):
            pairwise_similarity(["a", "b"], "embedding")
    else:
        pytest.skip("sentence-transformers installed: the error path does not apply")
