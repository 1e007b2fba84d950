"""Prompt texts shared by the benchmarks (plain-text completions; the serving benchmark adds a few)."""

PROMPT_TEXTS = [
    "The history of the printing press begins",
    "Write a short poem about the sea.",
    "Explain how a hash table works.",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "List three benefits of regular exercise:",
    "Translate 'good morning' into French:",
]
