"""Built-in policies (YAML data); installed as kvpolicy.policies."""
