"""The Ray Serve deployment that wraps one engine replica: the only Ray code in `replicas/`."""

from replicas.deployment.replica import EngineDeployment, EngineMetrics, GcsLiveness, RayLedger

__all__ = ["EngineDeployment", "EngineMetrics", "GcsLiveness", "RayLedger"]
