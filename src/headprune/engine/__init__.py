"""Where and how a run's work runs: the device, precision and process group the `trainer` config
asks for (`runtime.Runtime`, for runs with and without training) and a recovery's step budget as a
Lightning fit (`step_fit.fit_steps`)."""
from headprune.engine.runtime import Runtime, UnavailableRuntime
from headprune.engine.step_fit import FitPlan, fit_steps

__all__ = ["FitPlan", "Runtime", "UnavailableRuntime", "fit_steps"]
