"""Command-line entry points (headprune-train, -bench, -collect) and their Hydra config plumbing."""
