"""Operating backfills: the command line, the planner and launches through the webserver."""
