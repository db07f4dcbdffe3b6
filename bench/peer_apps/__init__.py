"""The peers' side of `--only peers`: apps and callers run in the peers' own
virtualenvs (.cache/bench-peers/NAME, from requirements-NAME.txt here).

Nothing here imports jobplane or the rest of bench/: these modules run where
only Celery or Procrastinate is installed.
"""
