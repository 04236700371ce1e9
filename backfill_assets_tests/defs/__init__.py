"""Tests of what Dagster loads: definitions, assets, sensors, the daemon's convergence."""
