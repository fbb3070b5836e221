"""One-function Python problems for base models: completion prompts, hidden tests, sealed grading."""
