"""CLI commands, one module per group; each defines configure(name, parser) and run(args)."""
