"""The Ray Serve deployment that wraps one engine replica: the only Ray code in `replicas/`.

`replica.py` is the deployment, `metrics.py` its metrics, `stats.py` what it reports and the
dicts those leave it as, `liveness.py` whether its callers are dead, `ledger.py` the adapter
ledger in Ray's GCS, and `ray_runtime.py` every call into Ray besides the deployment decorator.

Names are imported when first asked for: an ingress reads the ledger (`RayLedger`) and must not
import the engine with it (torch and the model code: seconds of its loop's GIL, the first time a
client lists the adapters).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from replicas.deployment.ledger import RayLedger
    from replicas.deployment.liveness import GcsLiveness
    from replicas.deployment.metrics import EngineMetrics
    from replicas.deployment.replica import EngineDeployment

__all__ = ["EngineDeployment", "EngineMetrics", "GcsLiveness", "RayLedger"]

_HOME = {
    "EngineDeployment": "replicas.deployment.replica",
    "EngineMetrics": "replicas.deployment.metrics",
    "GcsLiveness": "replicas.deployment.liveness",
    "RayLedger": "replicas.deployment.ledger",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
