"""Model parallelism: layer -> stage -> rank plans and pipeline schedules (framework-neutral)."""
