"""Command line, demo, self-checks, ahead-of-time kernel compilation, op counts and benchmark timing."""
