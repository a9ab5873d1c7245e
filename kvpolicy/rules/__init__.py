"""Rules: the engine that turns facts and a policy into a decision and its trace, and the built-in policy."""
