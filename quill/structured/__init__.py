"""Structured output: constraints a reply must match, and the token masks that enforce them."""
