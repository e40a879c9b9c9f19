"""Basin's offline pipeline: trajectories -> session table -> features -> ridge -> ONNX -> evaluation.

Every stage runs BLAS and OpenMP on one thread (set here, before a stage's `python -m basin_pipeline.<stage>`
imports numpy): a sum split across a machine's cores is added in another order, and the metrics and
ONNX bytes of a re-run must not depend on how many cores it had. A variable already set by the caller
is left alone.
"""

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                  "NUMEXPR_NUM_THREADS", "VECLIB_MAXIMUM_THREADS"):
    os.environ.setdefault(_variable, "1")
