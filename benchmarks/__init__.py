"""The project's benchmarks; ``python -m benchmarks`` runs them and writes a report."""
