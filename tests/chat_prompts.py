"""Twenty varied chat prompts (questions, instructions, arithmetic, code, translation, writing):
the default path's greedy replies are compared with the float-activation path's on them
(tests/test_outliers.py, benchmarks/default_path.py)."""

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain photosynthesis in one paragraph.",
    "Write a haiku about the ocean.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "How do I reverse a list in Python?",
    "What causes the seasons on Earth?",
    "Suggest a name for a pet goldfish.",
    "Summarize the plot of Cinderella in two sentences.",
    "What is the boiling point of water in Fahrenheit?",
    "List four planets in our solar system.",
    "Why is the sky blue?",
    "Write a short thank-you note to a teacher.",
    "What is the difference between a virus and a bacterium?",
    "How many days are there in a leap year?",
    "Give me a recipe idea for dinner using rice and beans.",
    "What does HTML stand for?",
    "Tell me a fun fact about octopuses.",
]
