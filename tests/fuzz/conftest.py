"""One hypothesis profile for the fuzz suite: reproducible, bounded, writing nothing here.

``derandomize`` makes every run draw the same examples (a failure reproduces by rerunning
the test); ``database=None`` stores no examples, and hypothesis's other caches go to the
temporary directory instead of ``.hypothesis/`` in the repository; no deadline, because a
shared 2-core machine makes single-example timings meaningless. Each test picks its own
``max_examples`` (see ``common.fuzz``) so that the whole directory stays under 90 s.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.configuration import set_hypothesis_home_dir

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "megatron3d-hypothesis")

settings.register_profile(
    "megatron3d-fuzz",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
)
