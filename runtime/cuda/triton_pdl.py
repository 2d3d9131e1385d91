"""The kernels' side of programmatic dependent launch (``runtime.cuda.pdl``): one Triton helper.

A PDL-aware kernel takes a ``PDL`` constexpr, issues its loads that do not depend on the previous
kernel (weights), then calls ``wait_then_release(PDL)`` before it reads any activation or writes
anything. With ``PDL`` false (eager launches, Triton's interpreter) the helper is empty.
"""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: runtime.cuda.pdl reports PDL unavailable, PDL stays False
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_then_release(PDL: tl.constexpr):
    if PDL:
        # Until the previous kernel has completed and its writes are visible ...
        gdc_wait()
        # ... then the next kernel may be placed on free SM slots (it waits on this one in turn).
        gdc_launch_dependents()
