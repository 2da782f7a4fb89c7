"""Varied prompts shared by engine tests."""

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Photosynthesis is the process by which",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Translate to French: Good morning, how are you?",
    "import numpy as np\nimport torch\n\n",
    "Q: What is the boiling point of water?\nA:",
    "In 1969, Neil Armstrong",
    "A recipe for pancakes: first,",
    "The best way to learn a programming language is",
    "Dear Sir or Madam, I am writing to",
    "SELECT name, age FROM users WHERE",
    "The mitochondria is",
    "Why is the sky blue? Because",
]
