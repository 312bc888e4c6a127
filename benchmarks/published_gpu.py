"""The estimator against published real-GPU measurements: prints estimate vs
published and the error per row, then the median and worst per metric.

The rows (``coursekit/data/published_gpu.json``) and the comparison live in
:mod:`coursekit.published`, so the book's chapters show the same numbers on a pip-only
install (Colab) as this report.

    python benchmarks/published_gpu.py
    python benchmarks/published_gpu.py --out benchmarks/results/published_gpu.md"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from coursekit.published import main  # noqa: E402

if __name__ == "__main__":
    main()
