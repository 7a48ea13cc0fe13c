"""Patterns on top of decoding: forks of a model state (branch), judging steps, SpecReason, step-level search, test-time scaling, answers, chat templates."""
