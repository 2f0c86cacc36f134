"""Tolerances for comparing a parallel run with the single-process reference, in one place.

fp32: parallel layouts reorder reductions (partial matmuls summed across ranks, all-reduced
gradients), which changes the last bits; over 10 Adam steps that stays within rtol 1e-5.
The atol covers values that are near zero, where a relative bound means nothing.
Bitwise cases (resume, replicas, tied copies) use torch.equal, not these.
"""

FP32 = {"rtol": 1e-5, "atol": 1e-6}

EQUIVALENCE_FLAGS = ("--adam-eps", "1e-6")
"""Flags every equivalence run adds. The attention key bias has an exactly-zero true
gradient (softmax ignores a shift shared by a whole row), so its computed gradient is rounding
noise (~1e-11) whose bits depend on the layout; Adam with eps 1e-8 divides it by ~1e-8 and
moves the bias by ~lr/100 per step in a layout-dependent direction. eps 1e-6 keeps that noise
below the tolerance while every real gradient (>= 1e-5 here) still sees Adam's scaling."""
