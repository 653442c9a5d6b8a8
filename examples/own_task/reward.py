"""Reward for the "larger of two numbers" example (docs/tasks.md, "Bring your own task")."""


def larger(prompt, completion, record):
    """1 for the right number; `format` (logged as reward/format) says whether it is a number."""
    answer = completion.strip()
    return {"score": float(answer == record["answer"]), "format": float(answer.isdigit())}
