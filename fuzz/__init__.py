"""Coverage-guided fuzzing of agck's parsers (targets.py; run with scripts/fuzz)."""
