"""Policy as code: lint, unit tests, deployment checks, diff and the starter of a team's policy files."""
