"""Tests of the demo's producers."""
