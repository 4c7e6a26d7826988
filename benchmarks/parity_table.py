"""The README's "Agreement with traker 0.3.2" table: max |ours − traker| / max |traker| of the scores, for the
recipes tests/compat/test_traker_parity.py asserts (identity projection; 1 and 3 checkpoints; float32 without λ on the
first layer, float32 with λ = 1e-2 on all parameters, float16 on the first layer), run through both libraries.

    python -m benchmarks run parity      # a few seconds; needs traker 0.3.2 (make test installs it)
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile
import warnings

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
sys.path[:0] = [os.path.join(TESTS, "compat"), TESTS]  # the parity recipes and the fixtures they import


def main() -> None:
    import logging

    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    import test_traker_parity as parity  # the recipes the tests assert, not a copy of them
    from trak_fixtures import rel_err

    rows = [
        ("float32", 1, {"grad_wrt": parity.FIRST_LAYER}, "1e-4"),
        ("float32", 3, {"grad_wrt": parity.FIRST_LAYER}, "1e-4"),
        ("float32", 1, {"lambda_reg": 1e-2}, "1e-4"),
        ("float32", 3, {"lambda_reg": 1e-2}, "1e-4"),
        ("float16", 3, {"grad_wrt": parity.FIRST_LAYER, "half": True}, "2e-2"),
    ]
    print("| storage | checkpoints | setting | tolerance asserted | max \\|ours − traker\\| / max \\|traker\\| |")
    print("|---|---|---|---|---|")
    for storage, k, kw, tol in rows:
        with tempfile.TemporaryDirectory() as tmp:
            ours, theirs = parity._both(pathlib.Path(tmp), k, **kw)
        what = "λ = 1e-2, all parameters" if "lambda_reg" in kw else "λ = 0, first layer"
        print(f"| {storage} | {k} | {what} | {tol} | {rel_err(ours, theirs):.1e} |")


if __name__ == "__main__":
    main()
