"""Structured outputs: requests whose output must match a JSON schema, a regex, a choice or a grammar."""
