"""Tests of what operators run: the CLI, the planner, the UI, the demo's stop."""
