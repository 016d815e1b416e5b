"""The Ray Serve deployment that wraps one engine replica: the only Ray code in `replicas/`.

`replica.py` is the deployment, `metrics.py` its metrics, `stats.py` what it reports and the
dicts those leave it as, `liveness.py` whether its callers are dead, `ledger.py` the adapter
ledger in Ray's GCS, and `ray_runtime.py` every call into Ray besides the deployment decorator.
"""

from replicas.deployment.ledger import RayLedger
from replicas.deployment.liveness import GcsLiveness
from replicas.deployment.metrics import EngineMetrics
from replicas.deployment.replica import EngineDeployment

__all__ = ["EngineDeployment", "EngineMetrics", "GcsLiveness", "RayLedger"]
