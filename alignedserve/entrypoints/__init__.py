"""The HTTP server, the command line and the offline ``LLM`` API: everything a user calls."""
