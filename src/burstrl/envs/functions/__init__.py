"""One-function Python problems for base models: completion prompts, cases as data, and grading that runs
the candidate apart from the expected values (`grade.py`)."""
