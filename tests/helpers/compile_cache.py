"""The compile cache every --compile test shares (``TORCHINDUCTOR_CACHE_DIR``): one directory
per user that outlives the session, so inductor's precompiled header and the kernels tiny
models share are built once, not per test or per process."""

from __future__ import annotations

import os
import tempfile

CACHE = os.path.join(tempfile.gettempdir(), f"megatron3d-test-compile-{os.getuid()}")
