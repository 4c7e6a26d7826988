"""The core's one top-k (trak_core.scoring.topk), which the index's queries, the report and the CLI's tables use,
against a
stable sort (the report's former ranking): ties by the lower row, −0.0 as 0.0, NaN after every number at either end,
k above n, blocks of rows in any order."""

import numpy as np
import pytest

from tasks.report import top_k as report_top_k
from trak_core.errors import BadInputError
from trak_core.scoring.topk import RunningTopK, top_k


def stable(scores: np.ndarray, k: int, opponents: bool) -> np.ndarray:
    """(m, min(k, n)) rows per column by a stable argsort (NaN last at both ends)."""
    s = scores + np.float32(0.0)
    cols = [np.argsort(s[:, j] if opponents else -s[:, j], kind="stable")[:k] for j in range(s.shape[1])]
    return np.stack(cols)


def scores_with_ties(n: int = 90, m: int = 4, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    s = rng.integers(-3, 4, size=(n, m)).astype(np.float32)
    s[s == 0] = -0.0
    s[::11] = 0.0
    s[3::13, 1] = np.nan
    s[5, 2], s[6, 2], s[7, 3] = np.inf, -np.inf, np.nan
    s[:, 0] *= np.float32(1e-30)  # tiny values
    return s


@pytest.mark.parametrize("k", [1, 5, 90, 200])
@pytest.mark.parametrize("opponents", [False, True])
def test_top_k_is_the_stable_sort(k, opponents):
    s = scores_with_ties()
    want = stable(s, k, opponents)
    idx, val = top_k(s, k, opponents)
    np.testing.assert_array_equal(idx, want)
    np.testing.assert_array_equal(val, np.take_along_axis((s + np.float32(0.0)).T, want, 1))  # NaN == NaN here
    for block in (7, 33):  # the index's way: blocks of rows, in reverse order
        t = RunningTopK(s.shape[1], k, opponents)
        for a in reversed(range(0, s.shape[0], block)):
            t.add(a, s[a : a + block])
        np.testing.assert_array_equal(t.result()[0], want)


def test_the_report_ranks_with_the_core_top_k():
    s = scores_with_ties(seed=1)
    for j in range(s.shape[1]):
        pro, opp = report_top_k(s, j, 6)
        np.testing.assert_array_equal(pro, stable(s[:, j : j + 1], 6, False)[0])
        np.testing.assert_array_equal(opp, stable(s[:, j : j + 1], 6, True)[0])
    assert np.isnan(s[3, 1]) and 3 not in report_top_k(s, 1, 6)[0] and 3 not in report_top_k(s, 1, 6)[1]


def test_bad_shapes_are_refused():
    with pytest.raises(BadInputError, match="expected \\(rows, columns\\)"):
        top_k(np.zeros(5, dtype=np.float32), 2)
    with pytest.raises(BadInputError, match="expected \\(rows, 3\\)"):
        RunningTopK(3, 2).add(0, np.zeros((4, 2), dtype=np.float32))
