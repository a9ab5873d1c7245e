"""Facts: everything a rule may test, derived once per deployment from the inputs."""
